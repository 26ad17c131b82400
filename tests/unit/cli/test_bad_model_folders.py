"""A damaged model folder, one case per row, against every command that loads a model from a path
(issue 37 item 3): `train` (its preflight, before the run directory), `data inspect` and `generate`
each give one line naming the file and what is wrong, exit 2, no traceback, and write nothing.
Headers are checked without loading (model/files.py); config.json's values by transformers."""

from __future__ import annotations

import json
import shutil
import struct

import build_recipe
import pytest

from homelab_ft.cli.main import main


def _header(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path, header, data: bytes) -> None:
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


def _header_list(model):
    _, data = _header(model / "model.safetensors")
    _write(model / "model.safetensors", [1, 2, 3], data)


def _overlapping(model):
    header, data = _header(model / "model.safetensors")
    tensors = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    first, second = header[tensors[0]], header[tensors[1]]
    if first["dtype"] == second["dtype"] and first["shape"] == second["shape"]:
        second["data_offsets"] = list(first["data_offsets"])
    else:  # shift the second into the first's last byte, keeping its size
        start, end = second["data_offsets"]
        second["data_offsets"] = [start - 1, end - 1]
    _write(model / "model.safetensors", header, data)


def _out_of_range(model):
    header, data = _header(model / "model.safetensors")
    key = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    start, end = header[key]["data_offsets"]
    header[key]["data_offsets"] = [start + 64, end + 64]
    _write(model / "model.safetensors", header, data)


def _entry_without_dtype(model):
    header, data = _header(model / "model.safetensors")
    key = next(k for k in header if k != "__metadata__")
    del header[key]["dtype"]
    _write(model / "model.safetensors", header, data)


def _config_value(model):
    config = json.loads((model / "config.json").read_text())
    config["hidden_size"] = str(config["hidden_size"])
    (model / "config.json").write_text(json.dumps(config))


def _tokenizer_json(model):
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": 5}}')


CASES = {
    # name: (damage, what the line says)
    "header is a JSON list": (_header_list, "model.safetensors has a damaged safetensors header (a JSON list"),
    "tensors overlap": (_overlapping, "share bytes"),
    "offsets past the end": (_out_of_range, "model.safetensors is truncated"),
    "entry without dtype": (_entry_without_dtype, "damaged safetensors header (entry"),
    "config size as a string": (_config_value, "config.json is not a config transformers accepts"),
    "tokenizer.json damaged": (_tokenizer_json, "cannot load a tokenizer from"),
}
COMMANDS = ("train", "data inspect", "generate")


@pytest.fixture()
def damaged(tmp_path, tiny_model_dir):
    def make(case: str):
        model = tmp_path / "model"
        shutil.copytree(tiny_model_dir, model)
        CASES[case][0](model)
        return model

    return make


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_model_folder_is_one_line_and_writes_nothing(capsys, tmp_path, damaged, case, command):
    model = damaged(case)
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}\n' * 4)
    recipe = build_recipe.write_recipe(tmp_path / "r.yaml", build_recipe.tiny_run(
        model, rows=data, lora=None, train={"max_steps": 1, "micro_batch_size": None}))
    run = tmp_path / "run"
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = {"train": ["train", str(recipe), "--run-dir", str(run)], "data inspect": ["data", "inspect", str(recipe)],
            "generate": ["generate", str(model), "--prompt", "hi"]}[command]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert CASES[case][1] in err and str(model) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no run directory, nothing beside
