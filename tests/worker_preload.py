"""What every tests/distributed/worker.py process imports, loaded once per pytest process into the
forkserver its ranks are forked from (procs.Workers): torch, transformers' model classes, PEFT (which
imports bitsandbytes), torch's distributed engines and the trainer cost ~8 CPU s a fresh interpreter,
about all a tiny model's few steps cost a rank. Nothing here starts a thread or touches a device, so
forking after it is safe (CUDA is never initialised before the fork)."""

import gc

import bitsandbytes  # noqa: F401
import peft  # noqa: F401
import torch  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import transformers

import homelab_ft.distributed.parallelize  # noqa: F401
import homelab_ft.train.trainer  # noqa: F401

transformers.AutoModelForCausalLM, transformers.LlamaForCausalLM  # noqa: B018  (lazy: resolved now)

gc.collect()
gc.freeze()  # the preloaded libraries out of every rank's collections (tests/conftest.py: _freeze_garbage_collector)
