"""The refusal of a checkpoint that does not fit the model (issue 39.3): each changed key with its
old and new value, the restoring overrides only when the checkpoint recorded its settings, and
--overwrite never offered without saying it deletes the run."""

from __future__ import annotations

from pathlib import Path

from homelab_ft.recipe.config import load_recipe
from homelab_ft.store import checkpoint


def _state(built_from):
    return checkpoint.TrainerState(step=2, scheduler={}, sampler={}, model_fingerprint="lora:m:100", world_size=1,
                                   built_from=built_from)


def _settings(tmp_path: Path, *overrides: str) -> dict:
    (tmp_path / "r.yaml").write_text("model: {path: m}\n")
    return checkpoint.built_from(load_recipe(tmp_path / "r.yaml", list(overrides)), method="lora")


def test_each_changed_key_is_named_with_both_values_and_restored(tmp_path):
    old = _settings(tmp_path, "lora.r=4", "lora.target_modules=[q_proj, v_proj]", "lora.use_dora=true")
    new = _settings(tmp_path)
    said = checkpoint.refusal(Path("ck"), recorded=_state(old), model_fingerprint="lora:m:200", settings=new)
    assert '(lora.r: 4 -> 16, lora.target_modules: ["q_proj", "v_proj"] -> all-linear, lora.use_dora: true -> false)' in said
    assert """resume with lora.r=4 'lora.target_modules=["q_proj", "v_proj"]' lora.use_dora=true,""" in said
    assert "deleting this run and its checkpoints" in said and "output.overwrite=true" not in said
    # the overrides offered are ones the recipe reader takes back to the recorded values
    restore = ["lora.r=4", 'lora.target_modules=["q_proj", "v_proj"]', "lora.use_dora=true"]
    assert checkpoint.changed_keys(old, _settings(tmp_path, *restore)) == []


def test_a_checkpoint_without_recorded_settings_offers_no_values(tmp_path):
    said = checkpoint.refusal(Path("ck"), recorded=_state(None), model_fingerprint="lora:m:200",
                              settings=_settings(tmp_path))
    assert "lora:m:100, here lora:m:200" in said and "predates" in said and "resume with lora" not in said
    assert "deleting this run and its checkpoints" in said


def test_same_settings_point_at_the_model_files(tmp_path):
    same = _settings(tmp_path)
    said = checkpoint.refusal(Path("ck"), recorded=_state(same), model_fingerprint="lora:m:200", settings=same)
    assert "the model at model.path changed since" in said and "resume with" not in said


def test_older_trainer_state_files_still_read(tmp_path):
    (tmp_path / "trainer_state.json").write_text('{"step": 1, "scheduler": {}, "sampler": {}, '
                                                 '"model_fingerprint": "x", "world_size": 1}')
    assert checkpoint.read_state(tmp_path).built_from is None


def test_the_early_check_refuses_only_keys_that_shape_the_tensors(tmp_path):
    """Before anything is built: lora.r refused for an adapter run; lora.dropout (same tensors) and,
    for a full fine-tune, lora.r pass on to the load's fingerprint check."""
    import json

    import pytest

    from homelab_ft.errors import UserError

    ck = tmp_path / "ck"
    ck.mkdir()
    state = _state(_settings(tmp_path, "lora.r=4"))
    (ck / "trainer_state.json").write_text(json.dumps(state.__dict__))
    with pytest.raises(UserError, match=r"\(lora\.r: 4 -> 16\).*resume with lora\.r=4,"):
        checkpoint.check_settings(ck, settings=_settings(tmp_path), adapters=True)
    checkpoint.check_settings(ck, settings=_settings(tmp_path, "lora.r=4", "lora.dropout=0.2"), adapters=True)
    checkpoint.check_settings(ck, settings=_settings(tmp_path), adapters=False)
