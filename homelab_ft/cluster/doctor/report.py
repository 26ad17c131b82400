"""`homelab-ft doctor`'s verdicts and table, as pure functions over what the nodes reported.

doctor.py probes each node and times the collectives; this module turns those facts into one line
per check with a verdict (ok / warn / FAIL) and, for every line that is not ok, the fix. It also
writes the `cluster:` values of the cluster file. No torch, no I/O: the unit tests feed it facts
(doctor_facts.py) and read the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from homelab_ft.cluster.doctor.facts import LinkResult, Needs, NodeFacts

OK, WARN, FAIL = "ok", "warn", "FAIL"
GiB = 2**30

VERSION_KEYS = ("python", "torch", "cuda", "nccl", "transformers", "peft", "bitsandbytes", "homelab-ft")
MUST_MATCH = {"python", "torch", "nccl", "transformers", "peft", "homelab-ft"}
"""A mismatch here is a FAIL: ranks on different torch/NCCL versions can hang in a collective or
disagree on a checkpoint's format, and different transformers/peft/homelab-ft versions build
different models from the same recipe. CUDA runtime and bitsandbytes differences only warn."""
REQUIRED = {"python", "torch", "transformers", "peft", "homelab-ft"}

SLOW_LINK_FRACTION = 0.5
"""Below half the NIC's line rate the link is not what the hardware promises (TCP and gloo reach
90-97% of it on a clean link: 47.6 of 50 Mbit/s measured through a tbf-shaped namespace pair)."""
HIGH_LATENCY_MS = 5.0
"""A wired LAN's small all-reduce takes 0.1-1 ms; above 5 ms the path runs over Wi-Fi, a VPN or a
congested switch, and FSDP's many small collectives per step add up."""


@dataclass(frozen=True)
class Line:
    check: str
    node: str
    result: str
    verdict: str = OK
    fix: str = ""


# ------------------------------------------------------------------------------------------------
# formatting helpers


def rate(gbit: float | None) -> str:
    if gbit is None:
        return "?"
    return f"{gbit:.2f} Gbit/s" if gbit >= 1 else f"{gbit * 1000:.1f} Mbit/s"


def size(nbytes: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{int(nbytes)} B"


# ------------------------------------------------------------------------------------------------
# checks


def version_lines(nodes: list[NodeFacts]) -> list[Line]:
    """One line per library: the version everywhere, or which node has which."""
    lines = []
    for key in VERSION_KEYS:
        seen = {n.name: n.versions.get(key) for n in nodes}
        values = sorted({v or "not installed" for v in seen.values()})
        if len(values) == 1:
            value = values[0]
            where = "all" if len(nodes) > 1 else nodes[0].name
            if value == "not installed" and key in REQUIRED:
                lines.append(Line(key, where, value, FAIL, f"install {key} (`make install` sets up every dependency)"))
            elif value == "not installed" and key in ("cuda", "nccl"):
                lines.append(Line(key, where, "none (CPU build of torch)" if key == "cuda" else "none"))
            elif value == "not installed":
                lines.append(Line(key, where, value, WARN, "QLoRA needs it: pip install bitsandbytes"))
            else:
                lines.append(Line(key, where, value))
            continue
        if key == "python":
            minor = {".".join((v or "").split(".")[:2]) for v in seen.values()}
            verdict = FAIL if len(minor) > 1 else WARN
        else:
            verdict = FAIL if key in MUST_MATCH else WARN
        detail = ", ".join(f"{name}: {v or 'not installed'}" for name, v in seen.items())
        head = nodes[0].versions.get(key)
        fix = (f"install the same {key} on every node (the head node has {head or 'none'}); `make install` in the "
               "same checkout on each gives identical versions")
        lines.append(Line(key, "differs", detail, verdict, fix))
    return lines


def device_lines(nodes: list[NodeFacts], *, wants_cuda: str | None) -> list[Line]:
    """A recipe that names CUDA (`wants_cuda`: the key that does, e.g. `train.device=cuda`) on a node
    whose ranks compute on the CPU: a FAIL, since the run would stop there (or, planned from this
    check, be priced for a CPU). A CPU build of torch (no `torch.version.cuda`) needs another wheel;
    a CUDA build that sees no GPU needs the driver or CUDA_VISIBLE_DEVICES looked at."""
    lines = []
    for n in nodes:
        if not wants_cuda or n.device == "cuda":
            continue
        if n.versions.get("cuda") is None:
            lines.append(Line("device", n.name, f"the recipe sets {wants_cuda}, but torch {n.versions.get('torch')} is a "
                              "CPU-only build", FAIL,
                              "install a CUDA build of torch (the command for your CUDA version is on pytorch.org, "
                              "e.g. `pip install torch --index-url https://download.pytorch.org/whl/cu128`), or set "
                              "train.device=cpu cluster.device=cpu to train on the CPU"))
        else:
            lines.append(Line("device", n.name, f"the recipe sets {wants_cuda}, but torch (CUDA {n.versions['cuda']}) "
                              "sees no GPU", FAIL,
                              "check `nvidia-smi` and the driver, and that CUDA_VISIBLE_DEVICES is not empty; or set "
                              "train.device=cpu cluster.device=cpu to train on the CPU"))
    return lines


def gpu_lines(nodes: list[NodeFacts]) -> list[Line]:
    lines = []
    for n in nodes:
        if n.device != "cuda":
            speed = f", fp32 matmul {n.cpu_gflops_per_core:g} GFLOPS per core" if n.cpu_gflops_per_core else ""
            lines.append(Line("GPUs", n.name, f"none; {n.nproc} CPU process(es) over gloo{speed}"))
            continue
        kinds: dict[str, int] = {}
        for g in n.gpus:
            label = f"{g['name']} {g['memory_bytes'] / GiB:.1f} GiB, cc {g['capability']}, bf16 {'yes' if g['bf16'] else 'no'}"
            if g.get("matmul_tflops"):
                label += f", matmul {g['matmul_tflops']:g} TFLOPS"
            kinds[label] = kinds.get(label, 0) + 1
        result = "; ".join(f"{count}x {label}" for label, count in kinds.items())
        if any(not g["bf16"] for g in n.gpus):
            lines.append(Line("GPUs", n.name, result, WARN,
                              "no bf16 on this GPU (compute capability < 8.0): training runs in fp16/fp32, which needs "
                              "more memory; plan with cluster.gpu_name set to it"))
        else:
            lines.append(Line("GPUs", n.name, result))
        if len(n.gpus) > 1:
            if n.no_peer_access:
                pairs = ", ".join(f"{a}<->{b}" for a, b in n.no_peer_access)
                lines.append(Line("peer-to-peer", n.name, f"no P2P between GPUs {pairs}", WARN,
                                  "collectives inside this node go through host memory: enable P2P (disable ACS/IOMMU "
                                  "for the PCIe switch in the BIOS) or expect slower intra-node traffic"))
            else:
                lines.append(Line("peer-to-peer", n.name, "every pair of GPUs" + (" (NVLink)" if n.nvlink else " (PCIe)")))
    names = {g["name"] for n in nodes for g in n.gpus}
    if len(names) > 1:
        lines.append(Line("GPU models", "differs", ", ".join(sorted(names)), WARN,
                          "the slowest GPU sets every step's pace and the smallest the memory plan; the cluster file "
                          "records the smallest"))
    return lines


def interface_lines(nodes: list[NodeFacts]) -> list[Line]:
    lines = []
    for n in nodes:
        speed = f", NIC {rate(n.nic_speed_mbit / 1000)}" if n.nic_speed_mbit else ""
        result = f"{n.iface or '?'} ({n.address}){speed}"
        if n.iface_given and n.iface and n.iface != n.iface_given:
            lines.append(Line("interface", n.name, result, WARN,
                              f"the rendezvous went over {n.iface}, not --iface {n.iface_given}: put this node's "
                              f"{n.iface_given} address in the hostfile, or pass --iface {n.iface}"))
        elif n.iface is None:
            lines.append(Line("interface", n.name, f"no interface holds {n.address}", WARN,
                              "pass --iface with the LAN interface (`ip -br addr` lists them)"))
        else:
            lines.append(Line("interface", n.name, result))
    return lines


def link_lines(link: LinkResult, *, expected_gbit: float | None, expected_from: str,
               assumed_gbit: float | None = None) -> list[Line]:
    """Bandwidth of each collective (its best size) next to what the link should give, and
    the small all-reduce's latency. `assumed_gbit`: the recipe's cluster.inter_link_gbit."""
    lines = []
    label = "between nodes" if link.scope == "inter-node" else "inside node"
    for op in ("all_reduce", "all_gather"):
        big = link.best(op)
        if big is None:
            continue
        result = f"{rate(big.bus_gbit)} at {size(big.nbytes)}"
        if expected_gbit:
            share = big.bus_gbit / expected_gbit
            result += f" ({share:.0%}" if share >= 0.1 else f" ({share:.1%}"
            result += f" of the {expected_from}'s {rate(expected_gbit)})"
        check = f"{op.replace('_', '-')} {label}"
        if link.scope == "inter-node" and expected_gbit and big.bus_gbit < SLOW_LINK_FRACTION * expected_gbit:
            lines.append(Line(check, link.where, result, WARN,
                              f"the link carries under {SLOW_LINK_FRACTION:.0%} of the {expected_from}'s speed: check the "
                              "negotiated speed (`ethtool IF`), the cable and switch port, other traffic, or a slower "
                              "interface on the path (--iface)"))
        elif link.scope == "inter-node" and op == "all_reduce" and assumed_gbit and big.bus_gbit < SLOW_LINK_FRACTION * assumed_gbit:
            lines.append(Line(check, link.where, result, WARN,
                              f"the recipe assumes cluster.inter_link_gbit={assumed_gbit:g}; plan with the measured link "
                              "(write it with --out cluster.yaml and pass --cluster cluster.yaml)"))
        else:
            lines.append(Line(check, link.where, result))
    latency = link.latency_ms
    if latency is not None:
        result = f"{latency:.2f} ms (4-byte all-reduce)"
        if link.scope == "inter-node" and latency > HIGH_LATENCY_MS:
            lines.append(Line(f"latency {label}", link.where, result, WARN,
                              "a wired LAN answers in under 1 ms: check for Wi-Fi, a VPN or a busy switch on the path"))
        else:
            lines.append(Line(f"latency {label}", link.where, result))
    return lines


def storage_lines(nodes: list[NodeFacts], needs: Needs | None) -> list[Line]:
    lines = []
    for n in nodes:
        if not n.writable:
            lines.append(Line("run dir", n.name, f"{n.probe_dir} is not writable", FAIL,
                              "choose a --run-dir this user can write to"))
    if len(nodes) > 1:
        blind = [n.name for n in nodes if n.sees_token is False]
        where = nodes[0].probe_dir
        if blind:
            lines.append(Line("shared run dir", ", ".join(blind), f"does not see {where} of {nodes[0].name}", FAIL,
                              "every rank writes its own shards of each checkpoint: mount the run directory over NFS "
                              "(same path on every node) or pass a --run-dir on such a mount"))
        else:
            lines.append(Line("shared run dir", "all", f"{where} is the same directory on every node"))
    for n in nodes:
        if n.free_disk_bytes is None:
            continue
        result = f"{size(n.free_disk_bytes)} free at {n.probe_dir}"
        if needs and needs.disk_bytes and n.free_disk_bytes < needs.disk_bytes:
            lines.append(Line("disk", n.name, result + f", the run needs {size(needs.disk_bytes)}", FAIL,
                              "free space or lower train.keep_last (checkpoints are written before the oldest is "
                              "removed), or choose another --run-dir"))
        else:
            lines.append(Line("disk", n.name, result + (f", the run needs {size(needs.disk_bytes)}" if needs and needs.disk_bytes else "")))
    for n in nodes:
        result = f"{size(n.host_ram_bytes)} total, {size(n.available_ram_bytes)} available"
        need = needs.host_ram_bytes if needs else 0
        if need and n.host_ram_bytes < need:
            lines.append(Line("host RAM", n.name, result + f", the plan needs {size(need)}", FAIL,
                              "the plan's host RAM does not fit this node: see `homelab-ft plan` for a lighter option "
                              "(no cpu_offload, a smaller model) or add RAM"))
        elif need and n.available_ram_bytes < need:
            lines.append(Line("host RAM", n.name, result + f", the plan needs {size(need)}", WARN,
                              "other programs hold the memory the run needs; close them before training"))
        else:
            lines.append(Line("host RAM", n.name, result + (f", the plan needs {size(need)}" if need else "")))
    return lines


def plan_lines(needs: Needs | None) -> list[Line]:
    if needs is None:
        return []
    if needs.problem:
        return [Line("plan", needs.recipe, needs.problem, FAIL,
                     f"run `homelab-ft plan {needs.recipe}` and change the recipe or the cluster")]
    if needs.option is None:
        return [Line("plan", needs.recipe, "no rung of the ladder fits this cluster", FAIL,
                     f"`homelab-ft plan {needs.recipe}` lists what would fit")]
    return [Line("plan", needs.recipe, needs.option)]


def all_lines(nodes: list[NodeFacts], links: list[LinkResult], *, needs: Needs | None = None,
              assumed_gbit: float | None = None, wants_cuda: str | None = None) -> list[Line]:
    lines = version_lines(nodes) + device_lines(nodes, wants_cuda=wants_cuda) + gpu_lines(nodes) + interface_lines(nodes)
    nic = [n.nic_speed_mbit for n in nodes if n.nic_speed_mbit]
    for link in links:
        if link.scope == "inter-node" and len(nic) == len(nodes):
            lines += link_lines(link, expected_gbit=min(nic) / 1000, expected_from="NIC", assumed_gbit=assumed_gbit)
        else:
            lines += link_lines(link, expected_gbit=None, expected_from="", assumed_gbit=assumed_gbit)
    return lines + storage_lines(nodes, needs) + plan_lines(needs)


def exit_code(lines: list[Line]) -> int:
    return 2 if any(line.verdict == FAIL for line in lines) else 0


def format_table(lines: list[Line], *, title: str) -> str:
    """Columns CHECK / NODE / RESULT / VERDICT; each line that is not ok is followed by its fix."""
    header = Line("CHECK", "NODE", "RESULT", "VERDICT")
    widths = [max(len(getattr(line, name)) for line in [header, *lines]) for name in ("check", "node", "result")]
    out = [title, ""]
    for line in [header, *lines]:
        cells = [line.check.ljust(widths[0]), line.node.ljust(widths[1]), line.result.ljust(widths[2]), line.verdict]
        out.append("  ".join(cells).rstrip())
        if line.fix:
            out.append(" " * (widths[0] + 2) + f"fix: {line.fix}")
    failed = sum(line.verdict == FAIL for line in lines)
    warned = sum(line.verdict == WARN for line in lines)
    out += ["", f"{failed} FAIL, {warned} warn, {len(lines) - failed - warned} ok"]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------
# the cluster file


def cluster_values(nodes: list[NodeFacts], links: list[LinkResult]) -> dict:
    """The cluster file's `cluster:` section (config.ClusterConfig keys) from what was measured."""
    values: dict = {"nodes": len(nodes), "gpus_per_node": min(n.nproc for n in nodes)}
    cuda = all(n.device == "cuda" for n in nodes)
    values["device"] = "cuda" if cuda else "cpu"
    if cuda:
        gpus = [g for n in nodes for g in n.gpus]
        smallest = min(gpus, key=lambda g: g["memory_bytes"])
        values["vram_gib"] = round(smallest["memory_bytes"] / GiB, 2)
        values["gpu_name"] = smallest["name"]
        per_node = [round(min(g["memory_bytes"] for g in n.gpus) / GiB, 2) for n in nodes if n.gpus]
        if len(per_node) == len(nodes) and len(set(per_node)) > 1:  # uneven: a pipeline sizes its stages to each
            values["node_vram_gib"] = per_node
        measured = [g["matmul_tflops"] for g in gpus if g.get("matmul_tflops")]
        if measured:  # the slowest GPU sets every step's pace
            values["gpu_tflops"] = min(measured)
        values["intra_link"] = "nvlink" if all(n.nvlink for n in nodes) else "pcie"
    else:
        measured = [n.cpu_gflops_per_core for n in nodes if n.cpu_gflops_per_core]
        if measured:  # the slowest node's cores set every step's pace
            values["cpu_gflops_per_core"] = min(measured)
    values["host_ram_gib"] = round(min(n.host_ram_bytes for n in nodes) / GiB, 2)
    for scope, prefix in (("inter-node", "inter"), ("intra-node", "intra")):
        mine = [link for link in links if link.scope == scope and link.gbit]
        if mine:
            slowest = min(mine, key=lambda link: link.gbit)
            values[f"{prefix}_link_gbit"] = round(slowest.gbit, 4)
            values[f"{prefix}_latency_ms"] = round(max(link.latency_ms or 0.0 for link in mine), 4)
    return values
