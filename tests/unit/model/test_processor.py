"""model/processor.py: every tiny image-text family of tests/tiny_vlm.py whose processor
can be built here (TRAINED) is saved as a released
checkpoint is, its processor loads offline (without torchvision here), and the model that
`AutoModelForImageTextToText` builds from the folder sees the image."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_vlm import TRAINED, make_image, save_vlm

from homelab_ft.errors import UserError
from homelab_ft.model import processor as processors


@pytest.mark.parametrize("model_type", sorted(TRAINED))
def test_each_family_builds_loads_offline_and_its_model_sees_the_image(model_type, tmp_path):
    from PIL import Image
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    folder = save_vlm(tmp_path / model_type, model_type)
    config = AutoConfig.from_pretrained(folder)
    processor = processors.load_processor(folder, config)
    assert type(processor).__name__ == PROCESSOR_MAPPING_NAMES[model_type]
    assert json.loads((folder / "processor_config.json").read_text())["processor_class"] == type(processor).__name__
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    logits = []
    for colour in ((200, 30, 30), (30, 30, 200)):
        image = Image.open(make_image(tmp_path / f"{colour}.png", size=(70, 50), colour=colour))
        batch = processor(text=[text], images=[[image]], return_tensors="pt")
        with torch.no_grad():
            logits.append(model(**batch).logits[0, -1])
    assert not torch.allclose(logits[0], logits[1])  # the pixels reached the language model


def test_without_video_keeps_a_class_that_has_no_video_side():
    from transformers import LlavaProcessor, Qwen2VLProcessor

    assert processors.without_video(LlavaProcessor) is LlavaProcessor
    images_only = processors.without_video(Qwen2VLProcessor)
    assert images_only.__name__ == "Qwen2VLProcessor" and issubclass(images_only, Qwen2VLProcessor)
    assert processors.VIDEO not in images_only.get_attributes()


def test_a_folder_without_processor_files_is_one_line(tmp_path):
    from transformers import AutoConfig

    folder = save_vlm(tmp_path / "m", "llava")
    for name in ("processor_config.json", "preprocessor_config.json"):
        (folder / name).unlink(missing_ok=True)
    with pytest.raises(UserError, match="model.path: .*processor"):
        processors.load_processor(folder, AutoConfig.from_pretrained(folder))
