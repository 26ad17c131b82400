"""An image-text checkpoint's processor (its image processor, tokenizer and chat template), loaded
offline from the model folder.

`AutoProcessor` picks the family's processor class from the folder (processor_config.json, else the
config's model type). A class that lists a video processor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, SmolVLM,
InternVL) cannot be built without torchvision: `ProcessorMixin` checks each part against
`VideoProcessorMixin`, which transformers 5.25 defines only with torchvision, even when no video is
ever passed. Image rows need no video processor, so without torchvision the same class is loaded
`without_video`: its attribute list lacks the video part, everything else (image token expansion,
the chat template, `save_pretrained` under the family's own class name) is the family's own.
"""

from __future__ import annotations

import logging
from pathlib import Path

from homelab_ft.errors import UserError

log = logging.getLogger(__name__)

VIDEO = "video_processor"


def without_video(processor_class):
    """`processor_class` with its video processor left out of the parts it is built from (and
    saved with); the class itself when it has none. Same name, so a saved processor names the family's class."""
    attributes = [a for a in processor_class.get_attributes() if a != VIDEO]
    if len(attributes) == len(processor_class.get_attributes()):
        return processor_class
    return type(processor_class.__name__, (processor_class,), {
        "get_attributes": classmethod(lambda cls: list(attributes)), "__module__": processor_class.__module__,
        "__doc__": f"{processor_class.__name__} for images only (no torchvision: model/processor.py)."})


def processor_class(config):
    """The processor class `AutoProcessor` builds for `config`'s model type, or None (no processor)."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

    return PROCESSOR_MAPPING.get(type(config), None) if not getattr(config, "auto_map", None) else None


def load_processor(model_dir: Path, config, *, trust_remote_code: bool = False):
    """The checkpoint's processor from `model_dir` (offline), its video side left out where torchvision
    is missing; one line naming the folder when it cannot be loaded."""
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    cls = processor_class(config)
    try:
        if is_torchvision_available() or cls is None or without_video(cls) is cls:
            processor = AutoProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        else:
            processor = without_video(cls).from_pretrained(model_dir)
    except (OSError, ValueError, TypeError, ImportError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"model.path: cannot load the image processor of {model_dir} ({type(err).__name__}: "
                        f"{first[:200]}); copy the checkpoint's processor files (preprocessor_config.json or "
                        "processor_config.json, the tokenizer, the chat template) into the folder") from None
    if getattr(processor, "image_processor", None) is None:
        raise UserError(f"model.path: {model_dir} has no image processor (its processor is "
                        f"{type(processor).__name__}); an image-text run needs the checkpoint's preprocessor_config.json")
    return processor
