"""Launch command building (pure) and the cluster/strategy checks, without a process group."""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import build_recipe
import pytest
import torch

from homelab_ft.cluster import handoff, launch
from homelab_ft.cluster.handoff import Handoff
from homelab_ft.distributed import comm
from homelab_ft.errors import UserError
from homelab_ft.model_facts import ModelFacts
from homelab_ft.recipe.config import recipe_from_dict
from homelab_ft.rung import Rung

REPO = Path(__file__).resolve().parents[3]
FACTS = ModelFacts(num_blocks=2, vocab_size=320, tied_embeddings=True, embedding_name="model.embed_tokens")
MOE_FACTS = ModelFacts(num_blocks=48, vocab_size=151936, tied_embeddings=False, embedding_name="model.embed_tokens",
                       fused_experts=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))


def test_standalone_command_runs_the_same_train_under_torchrun():
    argv = launch.standalone_command("r.yaml", ["train.lr=1e-4", "--resume"], nproc_per_node=4, python="py")
    assert argv == ["py", "-m", "homelab_ft.cluster.supervise", "--standalone", "--nproc-per-node=4",
                    "-m", "homelab_ft", "train", "r.yaml", "train.lr=1e-4", "--resume"]


def test_hostfile_parsing():
    hosts = launch.parse_hostfile("# head first\nalice@10.0.0.1 slots=2\n\n10.0.0.2  # second box\n")
    assert hosts == [launch.Host("alice@10.0.0.1", "10.0.0.1"), launch.Host("10.0.0.2", "10.0.0.2")]
    for bad in ("", "# only a comment\n", "a b\n", "a\na\n"):
        with pytest.raises(UserError):
            launch.parse_hostfile(bad)
    ok = launch.parse_hostfile("gpu-box.lan\nroot@192.168.1.7\nfe80::1\nnode_2\n")
    assert [h.rdzv_address for h in ok] == ["gpu-box.lan", "192.168.1.7", "fe80::1", "node_2"]
    # a word that ssh would read as an option, or shell / URL characters: refused with the line number
    for bad in ("-oProxyCommand=touch%20x\n", "box\n-v\n", "a;b\n", "u@-host\n", "-u@host\n", "$(id)\n", "h:22\n"):
        with pytest.raises(UserError, match=r"line \d+: .* is not a host name or address"):
            launch.parse_hostfile(bad)


def test_node_commands_share_one_c10d_rendezvous_on_the_head():
    hosts = launch.parse_hostfile("me@box1\nbox2\n")
    cmds = launch.node_commands(hosts, "r.yaml", ["train.lr=1e-4"], nodes=2, nproc_per_node=2, port=29600,
                                iface="enp3s0", run_id="job1", workdir="/srv/ft", python="python")
    assert [c.host.address for c in cmds] == ["me@box1", "box2"]
    for c, head, addr in zip(cmds, ("true", "false"), ("box1", "box2"), strict=True):
        # torchrun's own agent, run by homelab_ft.cluster.supervise (one-line rendezvous failures)
        assert c.argv[:3] == ["python", "-m", "homelab_ft.cluster.supervise"]
        assert "--nnodes=2" in c.argv and "--nproc-per-node=2" in c.argv
        assert "--rdzv-backend=c10d" in c.argv and "--rdzv-endpoint=box1:29600" in c.argv
        assert "--rdzv-id=job1" in c.argv
        # the head hosts the store whatever its host name resolves to; each node names its own address
        assert f"--rdzv-conf=join_timeout=300,read_timeout=300,is_host={head}" in c.argv
        assert f"--local-addr={addr}" in c.argv
        assert c.argv[-4:] == ["homelab_ft", "train", "r.yaml", "train.lr=1e-4"]
        assert c.env == {"NCCL_SOCKET_IFNAME": "enp3s0", "GLOO_SOCKET_IFNAME": "enp3s0", "HOMELAB_FT_NODES": "box1,box2"}
    line = cmds[1].shell_line()
    assert line.startswith("cd /srv/ft && GLOO_SOCKET_IFNAME=enp3s0 HOMELAB_FT_NODES=box1,box2 NCCL_SOCKET_IFNAME=enp3s0 "
                           "python -m homelab_ft.cluster.supervise")
    doctor = launch.node_commands(hosts, None, ["--out=c.yaml"], nodes=2, nproc_per_node=1, command="doctor")
    assert doctor[0].argv[-4:] == ["-m", "homelab_ft", "doctor", "--out=c.yaml"]
    assert launch.ssh_argv(cmds[1])[:5] == ["ssh", "-o", "BatchMode=yes", "--", "box2"]


def test_node_commands_refuse_a_hostfile_that_contradicts_the_recipe():
    hosts = launch.parse_hostfile("a\nb\nc\n")
    with pytest.raises(UserError, match="3 host.*cluster.nodes is 2"):
        launch.node_commands(hosts, "r.yaml", [], nodes=2, nproc_per_node=1)
    with pytest.raises(UserError, match="port"):
        launch.node_commands(hosts[:2], "r.yaml", [], nodes=2, nproc_per_node=1, port=70000)


def _handoff(rung: Rung) -> Handoff:
    return Handoff(rung=rung, plan={"chosen": None}, facts=FACTS, model_dir="/m")


def test_the_handoff_survives_its_encoding_as_one_shell_word():
    rung = Rung("full", "hybrid_shard", True, nodes=2, procs_per_node=2, activation_checkpointing=True)
    sent = Handoff(rung=rung, plan={"chosen": {"step_s": 1.5}, "options": [{"label": "x" * 40}] * 50}, facts=MOE_FACTS,
                   model_dir="/models/llama 3", resume_from="/runs/r/checkpoints/step_00000010")
    text = sent.encode()
    assert Handoff.decode(text) == sent
    assert shlex.quote(text) == text  # pasted as is, no quoting
    assert len(text) < len(json.dumps(sent.to_dict())) / 4  # compressed: the plan repeats itself
    with pytest.raises(UserError, match="HOMELAB_FT_HANDOFF is damaged"):
        Handoff.decode(text[: len(text) // 2])


def test_every_node_gets_the_same_handoff_and_no_rung_overrides(tmp_path):
    rung = Rung("lora", "no_shard", False, nodes=2, procs_per_node=3)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("10.0.0.1\n10.0.0.2\n")
    hosts = launch.read_hosts(hostfile, nodes=2, port=29500)
    commands = launch.launch_commands(hosts, "r.yaml", ["train.lr=1e-4"], handoff=_handoff(rung), port=29500,
                                      iface=None, num_threads=2)
    assert {c.env[handoff.HANDOFF_VAR] for c in commands} == {_handoff(rung).encode()}
    for c in commands:
        assert "--nnodes=2" in c.argv and "--nproc-per-node=3" in c.argv  # the job's shape is the rung's
        assert c.argv[-2:] == ["r.yaml", "train.lr=1e-4"] and c.env["OMP_NUM_THREADS"] == "2"
        worker = {**c.env, "LOCAL_RANK": "0"}
        assert handoff.received(worker) == _handoff(rung)


def test_multi_node_recipe_is_not_started_by_train_alone(monkeypatch):
    for var in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    recipe = recipe_from_dict({"cluster": {"nodes": 2, "gpus_per_node": 2}})
    rung = Rung("lora", "no_shard", False, nodes=2, procs_per_node=2)
    with pytest.raises(UserError, match="homelab-ft launch --hosts"):
        launch.run_workers(recipe, "r.yaml", [], handoff=_handoff(rung))


def _env(world_size: int, num_nodes: int):
    return comm.DistEnv(0, 0, world_size, num_nodes, torch.device("cpu"), "gloo", True)


@pytest.mark.parametrize(
    "env, rung, message",
    [
        (_env(2, 1), Rung("full", "full_shard", False, procs_per_node=4), "started 2 processes"),
        (_env(4, 1), Rung("full", "hybrid_shard", False, nodes=2, procs_per_node=2), "placed the 4 ranks on 1 node"),
    ],
)
def test_job_checks(env, rung, message):
    with pytest.raises(UserError, match=message):
        comm.check_job(env, rung)


def test_job_check_accepts_a_consistent_job():
    comm.check_job(_env(4, 2), Rung("full", "hybrid_shard", False, nodes=2, procs_per_node=2))


def test_single_process_setup_needs_no_process_group(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    env = comm.setup(device_pref="cpu")
    assert (env.world_size, env.rank, env.is_main, env.distributed) == (1, 0, True, False)
    assert comm.all_reduce_sum(7, env) == 7.0


def test_unreachable_rendezvous_is_a_clear_error_within_the_timeout(monkeypatch):
    """Rank 1 of 2 waits for a master that never comes: a UserError after the timeout, no hang. (In
    this process: a join that fails leaves no process group behind, which the last line checks.)"""
    import torch.distributed as dist

    for name, value in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(comm.free_port())).items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    with pytest.raises(UserError) as err:
        comm.setup(device_pref="cpu", timeout_s=1)
    assert time.monotonic() - start < 60
    assert str(err.value).startswith("rank 1 could not join the process group at 127.0.0.1")
    assert "within 1 s" in str(err.value)
    assert not dist.is_initialized()


def test_workers_get_the_parents_decision(monkeypatch):
    """FSDP on a single GPU (to offload to the CPU) needs a process group: torchrun with 1 process,
    and the worker receives the rung, plan and model folder instead of planning again."""
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    calls = []
    monkeypatch.setattr(launch, "run_supervised", lambda argv, env: calls.append((argv, env)) or 0)
    rung = Rung("full", "full_shard", True)
    assert launch.run_workers(recipe_from_dict({}), "r.yaml", ["train.lr=1e-4"], handoff=_handoff(rung)) == 0
    argv, env = calls[0]
    assert "--nproc-per-node=1" in argv and argv[-2:] == ["r.yaml", "train.lr=1e-4"]
    assert handoff.received(env) is None  # the parent itself is not a worker
    received = handoff.received({**env, "LOCAL_RANK": "0"})
    assert received.rung == rung and received.model_dir == "/m" and received.plan == {"chosen": None}
    assert received.facts == FACTS  # the model facts too: the worker reads no config.json to learn them


def test_launch_plans_here_and_hands_the_rung_to_every_node(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """`homelab-ft launch`: planned and checked once, here; the nodes get the planner's rung in the
    handoff, not pinned as overrides, and `--run-dir` as train takes it (issue 39.6). (The tiny Llama, not the embedded GGUF: converting that took
    ~35 CPU s here, and its conversion is e2e/test_gguf_model.py's.)"""
    from homelab_ft.cli.main import main

    monkeypatch.chdir(tmp_path)
    recipe = build_recipe.write_recipe(tmp_path / "r.yaml", build_recipe.tiny_run(
        tiny_model_dir, method="auto", rows="demo:train", lora=None, data={"max_length": None}, train=None, output=None,
        cluster={"nodes": 2, "gpus_per_node": 1, "device": "cpu"}))
    hosts = tmp_path / "hosts"
    hosts.write_text("10.0.0.1\n10.0.0.2\n")
    assert main(["launch", str(recipe), "--hosts", str(hosts), "--run-dir", "runs/mine"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "homelab_ft.cluster.supervise" in ln]
    assert len(lines) == 2 and not any("method=" in ln or "sharding.strategy=" in ln for ln in lines)
    assert all(shlex.split(ln)[-1] == "output.dir=runs/mine" for ln in lines)  # every node trains into it
    words = {w.split("=", 1)[1] for ln in lines for w in shlex.split(ln) if w.startswith(f"{handoff.HANDOFF_VAR}=")}
    assert len(words) == 1
    sent = Handoff.decode(words.pop())
    assert sent.rung.nodes == 2 and sent.rung == Rung.from_dict(sent.plan["chosen"]["rung"])
    assert Path(sent.model_dir, "config.json").is_file() and sent.resume_from is None
    assert sent.facts.num_blocks == 2 and not sent.facts.tied_embeddings and not sent.facts.has_fused_experts  # tiny Llama


def test_torchrun_waits_for_a_step_and_a_checkpoint_after_a_signal():
    assert launch.shutdown_timeout_s({"chosen": None}) == 30
    plan = {"chosen": {"step_s": 5.0}, "checkpoint_bytes": 7_000_000_000}
    assert launch.shutdown_timeout_s(plan) == 30 + 10 + 70
