"""Checkpoint tensors found through transformers' own key conversion (model/checkpoint_keys.py).

Each family's checkpoint is in the layout its released models ship (keys_models.py): per-expert
MoE tensors, Nemotron-H's `backbone.*`, Qwen 3.5's image-text `model.language_model.*`, Gemma 3's legacy
`language_model.model.*`. Reading it
by parameter name found none of those tensors (the old sharded loader raised "has no weight
...experts.gate_up_proj"); read through the plan, every parameter equals what from_pretrained loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from keys_models import LEGACY_IMAGE_TEXT, MULTIMODAL, ORIGINAL_LAYOUT, save_original, saved_keys

from homelab_ft.errors import UserError
from homelab_ft.model import checkpoint_keys

FAMILIES = MULTIMODAL + LEGACY_IMAGE_TEXT + ORIGINAL_LAYOUT


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    return {family: save_original(tmp_path_factory.mktemp(family), family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_equals_from_pretrained(checkpoints, family):
    """(a) from_pretrained and (b) our reader on a meta model give identical tensors, for every
    parameter and persistent buffer the model has, and the family's conversion was really used."""
    from transformers import AutoModelForCausalLM

    model_dir = checkpoints[family]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    keys = checkpoint_keys.CheckpointKeys(checkpoint_keys.meta_model(model_dir), model_dir)
    got = dict(keys.tensors(sorted(keys.names())))
    assert set(got) >= set(reference) - {"lm_head.weight"}  # a tied head is re-tied, not read
    for name, tensor in got.items():
        assert torch.equal(tensor.float(), reference[name]), name
    renamed = [n for n in got if keys.sources(n) != (n,)]
    assert renamed, f"{family}: the checkpoint is already in the model's own names; the test proves nothing"
    if family in ORIGINAL_LAYOUT:
        assert any(keys.converted(n) for n in got)  # per-expert tensors stacked into 3-D parameters


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3", "mixtral", "nemotron_h"])
def test_sources_are_what_save_pretrained_writes(checkpoints, family, tmp_path):
    """The inverse: a model loaded from this checkpoint saves exactly the keys its parameters were
    read from (save_pretrained reverses the conversions used on load); a multimodal base's vision
    tower is not part of the text model and is not written."""
    from transformers import AutoModelForCausalLM

    model_dir = checkpoints[family]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    keys = checkpoint_keys.CheckpointKeys(model, model_dir)
    from_plan = {key for name in keys.names() for key in keys.sources(name)}
    assert saved_keys(tmp_path) == from_plan


def test_experts_split_over_files_read_one_tensor_at_a_time(tmp_path, monkeypatch):
    """An indexed checkpoint whose layer's experts lie in different files: the converter gets its
    tensors from each file, every tensor through its own safe_open."""
    from transformers import AutoModelForCausalLM

    base = save_original(tmp_path / "one", "mixtral")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.save_pretrained(tmp_path / "many", max_shard_size="20KB")
    many = tmp_path / "many"
    weight_map = json.loads((many / checkpoint_keys.INDEX).read_text())["weight_map"]
    experts = {f for k, f in weight_map.items() if ".layers.0.block_sparse_moe.experts." in k}
    assert len(experts) > 1
    opened = []
    real = checkpoint_keys.CheckpointKeys._read_one
    monkeypatch.setattr(checkpoint_keys.CheckpointKeys, "_read_one",
                        lambda self, key, **kw: opened.append(key) or real(self, key, **kw))
    got = dict(checkpoint_keys.checkpoint_tensors(checkpoint_keys.meta_model(many), many))
    reference = model.state_dict()
    assert all(torch.equal(got[n], reference[n]) for n in got)
    assert len(opened) == len(set(opened)) == len(weight_map)


def test_a_tensor_the_checkpoint_lacks_is_one_line(checkpoints):
    keys = checkpoint_keys.CheckpointKeys(checkpoint_keys.meta_model(checkpoints["mixtral"]), checkpoints["mixtral"])
    with pytest.raises(UserError, match="has no weight for model.layers.9.mlp.experts.down_proj"):
        list(keys.tensors(["model.layers.9.mlp.experts.down_proj"]))


def test_peft_names_are_base_names():
    assert checkpoint_keys.base_name("base_model.model.model.layers.0.mlp.gate.base_layer.weight") == \
        "model.layers.0.mlp.gate.weight"


@pytest.mark.parametrize("config_file", sorted((Path(__file__).parents[2] / "configs").glob("*.json")),
                         ids=lambda p: p.stem)
def test_real_configs_released_key_lists_cover_every_parameter(config_file):
    """Full-size configs on the meta device: the key list save_pretrained writes (the released
    layout; 18,867 keys for Qwen3-30B-A3B, planned in ~1.4 s here) maps onto every parameter, and a
    stacked expert parameter is made from its experts in expert order (10 after 9, not after 1)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    fields = json.loads(config_file.read_text())
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = model.state_dict()
    files = dict.fromkeys(revert_weight_conversion(model, dict(state)), config_file)
    groups, _ = checkpoint_keys.plan(model, files)
    assert set(groups) == set(state)
    for name, group in groups.items():
        if group.converter is not None and name.endswith("down_proj"):
            experts = [int(key.split(".experts.")[1].split(".")[0]) for _, key in group.sources]
            assert experts == list(range(state[name].shape[0]))
