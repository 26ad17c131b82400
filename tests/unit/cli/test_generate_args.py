"""`generate` and `chat` check what they are given before anything loads (issue 37): a bad decoding
flag is one line naming the flag and the fix, exit 2, argparse's usage block left out; a model
without a chat template is refused before its weights load, with the two ways on (--chat-template,
--raw); --raw and --chat-template do what they say."""

from __future__ import annotations

import json
import shutil

import pytest

from homelab_ft.cli.main import main

BAD_FLAGS = [
    (["--prompt", ""], "argument --prompt: the prompt is empty"),
    (["--prompt", "  "], "argument --prompt: the prompt is empty"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "argument --max-new-tokens: 0 generates nothing"),
    (["--prompt", "hi", "--max-new-tokens", "-1"], "argument --max-new-tokens: -1 generates nothing"),
    (["--prompt", "hi", "--max-new-tokens", "many"], "'many' is not a whole number"),
    (["--prompt", "hi", "--temperature", "-0.5"], "argument --temperature: -0.5 is out of range; give 0 (greedy) to 100"),
    (["--prompt", "hi", "--temperature", "nan"], "argument --temperature: nan is out of range"),
    (["--prompt", "hi", "--top-p", "0"], "argument --top-p: 0 is out of range; give a probability in (0, 1]"),
    (["--prompt", "hi", "--top-p", "1.5"], "argument --top-p: 1.5 is out of range"),
]


def _one_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and "usage:" not in err, err
    return err


@pytest.mark.parametrize("flags,line", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_bad_decoding_flag_is_one_line_before_anything_loads(capsys, tmp_path, monkeypatch, command, flags, line):
    from homelab_ft.model import loading

    monkeypatch.setattr(loading, "resolve_model_dir", lambda *a, **k: pytest.fail("a model was looked up"))
    target = "smollm2" if command == "generate" else str(tmp_path / "run")
    err = _one_line(capsys, [command, target, *flags])
    assert line in err and err.startswith(f"homelab-ft {command}: error:") and err.endswith(f"(see homelab-ft {command} -h)")


def _untemplated(tiny_model_dir, tmp_path):
    """The tiny model with its tokenizer's chat template removed (a base model's tokenizer)."""
    folder = tmp_path / "base"
    shutil.copytree(tiny_model_dir, folder)
    config = folder / "tokenizer_config.json"
    body = json.loads(config.read_text())
    body.pop("chat_template", None)
    config.write_text(json.dumps(body))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


def test_a_model_without_a_chat_template_is_refused_before_its_weights_load(capsys, tmp_path, tiny_model_dir, monkeypatch):
    from homelab_ft.model import loading

    folder = _untemplated(tiny_model_dir, tmp_path)
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the weights were loaded"))
    assert main(["generate", str(folder), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no chat template" in err, err
    assert "--chat-template FILE" in err and "--raw" in err


def test_raw_and_a_template_file_generate_on_it(capsys, tmp_path, tiny_model_dir):
    folder = _untemplated(tiny_model_dir, tmp_path)
    assert main(["generate", str(folder), "--prompt", "the quick", "--raw", "--max-new-tokens", "3"]) == 0
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    assert main(["generate", str(folder), "--prompt", "hi", "--chat-template", str(template),
                 "--max-new-tokens", "3", "--temperature", "0.7", "--top-p", "0.9"]) == 0
    capsys.readouterr()
    assert main(["generate", str(folder), "--prompt", "hi", "--raw", "--system", "be brief"]) == 2
    assert "--raw continues the prompt as plain text" in capsys.readouterr().err
    assert main(["generate", str(folder), "--prompt", "hi", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing.jinja" in err, err
