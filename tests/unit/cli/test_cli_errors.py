"""Bad input: one line naming what to fix, exit code 2, no traceback, nothing overwritten."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import build_recipe
import pytest

from homelab_ft.cli.main import main


def run_cli(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err


def recipe_file(tmp: Path, body: dict | str) -> Path:
    return build_recipe.write_recipe(tmp / "r.yaml", body)


def test_missing_recipe(capsys, tmp_path):
    assert "not found" in run_cli(capsys, "train", tmp_path / "nope.yaml")


def test_malformed_yaml(capsys, tmp_path):
    err = run_cli(capsys, "train", recipe_file(tmp_path, "train:\n  lr: [1,\n  x"))
    assert "r.yaml" in err and "not valid YAML" in err


def test_unknown_key_suggests_nearest(capsys, tmp_path):
    err = run_cli(capsys, "train", recipe_file(tmp_path, {"train": {"learning_rate": 1e-4, "max_step": 3}}))
    assert "train.max_step" in err or "train.learning_rate" in err
    err = run_cli(capsys, "train", recipe_file(tmp_path, {"train": {"max_step": 3}}))
    assert "unknown key train.max_step; did you mean train.max_steps?" in err


def test_wrong_type_and_range(capsys, tmp_path):
    assert "train.micro_batch_size" in run_cli(capsys, "train", recipe_file(tmp_path, {"train": {"micro_batch_size": "four"}}))
    assert "lora.dropout" in run_cli(capsys, "train", recipe_file(tmp_path, {"lora": {"dropout": 1.5}}))
    assert "train.lr" in run_cli(capsys, "train", recipe_file(tmp_path, {"name": "x"}), "train.lr=-1")


def test_bad_override_syntax(capsys, tmp_path):
    assert "key=value" in run_cli(capsys, "train", recipe_file(tmp_path, {"name": "x"}), "=3")


def test_missing_model_path_and_gguf(capsys, tmp_path):
    run = tmp_path / "run"
    err = run_cli(capsys, "train", recipe_file(tmp_path, {"model": {"path": str(tmp_path / "no-model")}}), "--run-dir", run)
    assert "model.path" in err and "no-model" in err
    err = run_cli(capsys, "train", recipe_file(tmp_path, {"model": {"path": str(tmp_path / "m.gguf")}}), "--run-dir", run)
    assert "GGUF file" in err and "m.gguf" in err
    err = run_cli(capsys, "train", recipe_file(tmp_path, {"model": {"path": "nobody/not-cached-model"}}), "--run-dir", run)
    assert "hf download nobody/not-cached-model" in err
    assert not run.exists()  # nothing is created for a run that cannot start


def test_missing_dataset_file(capsys, tmp_path, tiny_model_dir):
    body = {"model": {"path": str(tiny_model_dir)}, "data": {"sources": [{"path": "missing.jsonl"}]}}
    err = run_cli(capsys, "train", recipe_file(tmp_path, body), "--run-dir", tmp_path / "run")
    assert "missing.jsonl" in err
    assert not (tmp_path / "run").exists()


def test_output_dir_with_other_run_is_left_alone(capsys, tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text("name: another\n")
    (run / "notes.txt").write_text("precious")
    body = {"model": {"path": str(tiny_model_dir)}}
    err = run_cli(capsys, "train", recipe_file(tmp_path, body), "--run-dir", run)
    # No checkpoint to resume from: --resume is not offered, and --overwrite is said to delete the run.
    assert "already holds a run" in err and "--resume" not in err and "--overwrite to delete this run" in err
    assert (run / "notes.txt").read_text() == "precious"
    assert (run / "recipe.yaml").read_text() == "name: another\n"


def test_export_refuses_non_run_and_foreign_output(capsys, tmp_path):
    assert "not a homelab-ft run directory" in run_cli(capsys, "export", tmp_path, "--out", tmp_path / "x")


def test_no_traceback_from_the_console_entry_point(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "homelab_ft", "train", str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("homelab-ft: error:")
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------------------------
# every refusal before any side effect: one line, exit 2, no run directory, nothing loaded


@pytest.fixture()
def good(tmp_path, tiny_model_dir):
    """A recipe that would train: a copy of the tiny model (to damage) and a small dataset."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"}]}\n' * 8)
    return model, build_recipe.tiny_run(model, rows=data, lora=None, train={"max_steps": 1})


def refused(capsys, tmp_path, body, *extra) -> str:
    run = tmp_path / "run"
    err = run_cli(capsys, "train", recipe_file(tmp_path, body), "--run-dir", run, *extra)
    assert not run.exists(), err
    return err


def test_empty_recipe_is_an_error_not_the_demo(capsys, tmp_path):
    for text in ("", "# nothing yet\n", "{}\n"):
        err = run_cli(capsys, "train", recipe_file(tmp_path, text))
        assert "the recipe is empty" in err and "recipes/" in err


def test_training_data_is_never_defaulted(capsys, tmp_path, good):
    _, body = good
    del body["data"]["sources"]
    assert "data.sources is empty" in refused(capsys, tmp_path, body)


def test_model_folder_without_tokenizer_or_weights(capsys, tmp_path, good):
    model, body = good
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink(missing_ok=True)
    err = refused(capsys, tmp_path, body)
    assert "has no tokenizer" in err and str(model) in err
    (model / "model.safetensors").unlink()
    err = refused(capsys, tmp_path, body)
    assert "has config.json but no weights" in err and str(model) in err


def test_truncated_safetensors(capsys, tmp_path, good):
    model, body = good
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    err = refused(capsys, tmp_path, body)
    assert "model.safetensors is truncated" in err and f"of {len(data):,} bytes" in err
    weights.write_bytes(data[:5])
    assert "is truncated" in refused(capsys, tmp_path, body)


def test_corrupt_gguf(capsys, tmp_path, good):
    _, body = good
    for name, content in (("noise.gguf", b"not a gguf file at all"), ("cut.gguf", b"GGUF\x03\x00\x00\x00\x05")):
        (tmp_path / name).write_bytes(content)
        body["model"]["path"] = str(tmp_path / name)
        err = refused(capsys, tmp_path, body)
        assert name in err and ("not a GGUF file" in err or "damaged GGUF" in err)


def test_run_dir_that_is_a_file(capsys, tmp_path, good):
    _, body = good
    (tmp_path / "taken").write_text("keep me")
    err = run_cli(capsys, "train", recipe_file(tmp_path, body), "--run-dir", tmp_path / "taken")
    assert "is a file, not a directory" in err
    assert (tmp_path / "taken").read_text() == "keep me"


def test_resume_with_nothing_to_resume(capsys, tmp_path, good):
    _, body = good
    err = refused(capsys, tmp_path, body, "--resume")
    assert "nothing to resume" in err and "--resume-or-start" in err


def test_lora_target_typo_is_refused_before_loading(capsys, tmp_path, good):
    _, body = good
    body["lora"] = {"target_modules": ["q_proj", "v_prj"]}
    err = refused(capsys, tmp_path, body)
    assert "lora.target_modules: 'v_prj' matches no module" in err and "did you mean v_proj?" in err


def test_refused_rungs_stop_before_anything(capsys, tmp_path, good):
    _, body = good
    two = {"cluster": {"gpus_per_node": 2, "device": "cpu"}}
    err = refused(capsys, tmp_path, {**body, **two, "method": "qlora", "quant": {"bits": 8},
                                     "sharding": {"strategy": "full_shard"}})
    assert "8-bit base cannot be sharded" in err and "no_shard" in err
    # the sharded 4-bit base's bytes must be gathered in their storage dtype (checked from the recipe
    # and the model's config before launching)
    err = refused(capsys, tmp_path, {**body, **two, "method": "qlora",
                                     "sharding": {"strategy": "full_shard", "param_dtype": "bfloat16"}})
    assert "sharding.param_dtype=bfloat16" in err and "auto" in err
    err = refused(capsys, tmp_path, {**body, **two, "method": "full", "sharding": {"strategy": "full_shard"},
                                     "train": {**body["train"], "optimizer": "adamw_8bit"}})
    assert "cannot update FSDP2-sharded" in err
    err = refused(capsys, tmp_path, {**body, "sharding": {"strategy": "no_shard", "cpu_offload": True}})
    assert "needs a sharded strategy" in err


def test_memory_savers_a_rung_cannot_use(capsys, tmp_path, tiny_model_dir):
    """Refused in one line before any file is written: optimizer in backward with accumulation or
    clipping (recipe alone), or on an adapter rung (rung.py);
    activation offload without checkpointing."""
    run = tmp_path / "run"
    body = {"method": "full", "model": {"path": str(tiny_model_dir)}, "train": {"device": "cpu"}}
    recipe = recipe_file(tmp_path, body)
    err = run_cli(capsys, "train", recipe, "--run-dir", run, "train.optimizer_in_backward=true")
    assert "set train.max_grad_norm=0" in err
    err = run_cli(capsys, "train", recipe, "--run-dir", run, "train.optimizer_in_backward=true",
                  "train.max_grad_norm=0", "train.grad_accum_steps=2")
    assert "set train.grad_accum_steps=1" in err
    err = run_cli(capsys, "train", recipe, "--run-dir", run, "method=lora", "train.optimizer_in_backward=true",
                  "train.max_grad_norm=0")
    assert "train.optimizer_in_backward is for full fine-tunes" in err
    err = run_cli(capsys, "train", recipe, "--run-dir", run, "train.activation_offload=true",
                  "train.activation_checkpointing=false")
    assert "train.activation_checkpointing=true" in err
    assert not run.exists()


def test_attention_the_device_cannot_run(capsys, tmp_path, good):
    """flash_attention_2 used to pass validation, create the run directory, then fail inside
    from_pretrained with a traceback; the corrected retry was refused as 'already holds a run'."""
    from homelab_ft.errors import UserError
    from homelab_ft.train import preflight

    _, body = good
    body["model"]["attn_implementation"] = "flash_attention_2"
    assert "flash_attention_2 runs on CUDA GPUs only" in refused(capsys, tmp_path, body)
    with pytest.raises(UserError, match="needs the flash-attn package"):  # a GPU machine without flash-attn
        preflight.check_attention("flash_attention_2", device_type="cuda")


def test_dora_on_a_rung_that_cannot_initialise_it(capsys, tmp_path, good):
    """method=qlora with lora.use_dora used to create the run directory, then refuse while building."""
    _, body = good
    body.update(method="qlora")
    body["lora"] = {"use_dora": True}
    assert "lora.use_dora: DoRA is not supported with qlora" in refused(capsys, tmp_path, body)


def test_library_notes_add_no_line_to_an_error(capsys, tmp_path, monkeypatch):
    """Importing bitsandbytes on an AVX512-BF16 CPU asks `kernels` (a transformers >= 5.25 dependency)
    for a Hub kernel; offline, `kernels` warns that it skips a publisher check, and bitsandbytes warns
    when the kernel is not found. With no handler on the root logger, logging's last resort prints
    both to stderr, ahead of the one line an error gets (tests/distributed/test_train_command.py saw
    it from torchrun's parent). The CLI turns both loggers down before anything is imported."""
    run_cli(capsys, "train", tmp_path / "nope.yaml")
    monkeypatch.setattr(logging.root, "handlers", [])  # pytest's capture handler off: the last resort prints
    logging.getLogger("kernels._internals.hf_hub").warning("Skipping publisher trust check for 'x/y'")
    logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load CPU gemm_4bit_forward")
    assert capsys.readouterr().err == ""
