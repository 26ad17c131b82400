"""A full fine-tune's DCP checkpoint exported in the base's own layout (export/consolidate.py).

The trainer's checkpoint holds transformers' parameter names (stacked `experts.gate_up_proj`,
`model.layers.*`); the export now writes what save_pretrained writes for the base's layout
(per-expert tensors, `backbone.*`, `model.language_model.*`), through transformers' reverse
conversion, and the folder reloads with from_pretrained to exactly the trained tensors.
Before, it wrote the parameter names: loadable by transformers 5, but not the released layout.
"""

from __future__ import annotations

import pytest
import torch
from keys_models import save_original, saved_keys

from homelab_ft.export import consolidate


@pytest.mark.parametrize(("family", "shard_bytes"), [("mixtral", 5 * 2**30), ("nemotron_h", 5 * 2**30),
                                                    ("qwen3_5_moe", 5 * 2**30), ("mixtral", 40_000)])
def test_consolidated_export_keeps_the_base_layout(tmp_path, family, shard_bytes):
    """Many files: a layer's experts are one unit, so each file holds whole experts' tensors."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    base_dir = save_original(tmp_path / "base", family)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(0)
    trained = {n: t + 0.01 * torch.randn_like(t) if t.is_floating_point() else t for n, t in model.state_dict().items()}
    tied = model.get_expanded_tied_weights_keys(all_submodels=True)
    state = {n: t for n, t in trained.items() if n not in tied}
    dcp.save({"model": state}, checkpoint_id=tmp_path / "step" / "state", no_dist=True)

    diff = consolidate.consolidate_to_hf(tmp_path / "step", base_dir, tmp_path / "out", max_shard_bytes=shard_bytes)
    assert diff == 0.0
    assert (len(list((tmp_path / "out").glob("*.safetensors"))) > 1) == (shard_bytes < 2**20)
    expected = saved_keys(base_dir) if family != "qwen3_5_moe" else {k for k in saved_keys(base_dir) if ".visual." not in k}
    assert saved_keys(tmp_path / "out") == expected  # the base's layout (a text fine-tune carries no vision tower)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict()
    assert all(torch.equal(reloaded[n], state[n]) for n in state)


def test_consolidated_files_get_the_folder_mode(tmp_path, tiny_model_dir, umask_027):
    """Issue 39.4: the weights (safetensors writes 600) and the base's files copied beside them (a
    private config.json in the base) all get the mode a new file gets under the umask."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from tiny import file_modes
    from transformers import AutoModelForCausalLM

    base_dir = shutil.copytree(tiny_model_dir, tmp_path / "base")
    (base_dir / "config.json").chmod(0o600)
    state = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).state_dict()
    dcp.save({"model": state}, checkpoint_id=tmp_path / "step" / "state", no_dist=True)
    consolidate.consolidate_to_hf(tmp_path / "step", base_dir, tmp_path / "out")
    modes = file_modes(tmp_path / "out")
    assert {"model.safetensors", "config.json"} <= set(modes) and set(modes.values()) == {umask_027}, modes
