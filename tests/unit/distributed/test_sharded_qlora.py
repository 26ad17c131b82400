"""The sharded 4-bit base's pure checks and pricing (no process group; the 2-process runs are in
tests/distributed/test_qlora_fsdp.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from homelab_ft.distributed.sharded_qlora import check_model, check_recipe
from homelab_ft.errors import UserError
from homelab_ft.model.quant import check_shardable, packed_numel
from homelab_ft.plan.inputs import Cluster
from homelab_ft.plan.ladder import option_rung
from homelab_ft.plan.planner import default_request
from homelab_ft.plan.price.memory import GiB, estimate
from homelab_ft.plan.price.params import quant_state_bytes
from homelab_ft.plan.shape.shapes import model_shape
from homelab_ft.recipe.config import recipe_from_dict
from homelab_ft.rung import Rung

torch = pytest.importorskip("torch")
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_packed_numel_is_the_4bit_bytes_in_storage_elements():
    assert packed_numel(4096, 4096, storage_bytes=2) == 4096 * 4096 // 4  # bf16: 4 values per element
    assert packed_numel(4096, 4096, storage_bytes=4) == 4096 * 4096 // 8  # fp32: 8 values per element
    assert packed_numel(40, 27, storage_bytes=4) == 135  # odd, split 68 + 67 by FSDP2
    assert packed_numel(6, 1, storage_bytes=4) is None  # 3 bytes are not a whole fp32


def test_check_shardable_refuses_in_one_line():
    check_shardable({"q": (64, 64), "odd": (40, 27)}, storage_bytes=4, shard_size=2)
    with pytest.raises(UserError, match=r"layer tiny \(6 x 1\) packs into 3 bytes.*no_shard") as err:
        check_shardable({"tiny": (6, 1)}, storage_bytes=4, shard_size=2)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="too small to split over 4 ranks"):
        check_shardable({"small": (8, 2)}, storage_bytes=4, shard_size=4)  # 16 values: 2 fp32 elements


def _recipe(**sections):
    return recipe_from_dict({"method": "qlora", "sharding": {"strategy": "full_shard"},
                             "cluster": {"gpus_per_node": 2}, **sections})


def test_check_recipe_refuses_8bit_and_a_casting_param_dtype():
    check_recipe(_recipe(), compute_dtype=torch.float32)
    with pytest.raises(UserError, match="quant.bits=8"):
        check_recipe(_recipe(quant={"bits": 8}), compute_dtype=torch.float32)
    with pytest.raises(UserError, match="sharding.param_dtype=bfloat16.*auto"):
        check_recipe(_recipe(sharding={"strategy": "full_shard", "param_dtype": "bfloat16"}), compute_dtype=torch.float32)
    with pytest.raises(UserError, match="compute_dtype=float16.*bfloat16"):
        check_recipe(_recipe(quant={"compute_dtype": "float16"}), compute_dtype=torch.float16)


def test_check_model_reads_the_skeleton_of_a_config():
    pytest.importorskip("bitsandbytes")
    config = json.loads((CONFIGS / "llama-3.2-1b.json").read_text())
    rung = Rung("qlora", "full_shard", False, procs_per_node=2)
    check_model(config, _recipe(), rung=rung, device_type="cpu")
    with pytest.raises(UserError, match="stored quantized"):
        check_model({**config, "quantization_config": {"quant_method": "gptq"}}, _recipe(), rung=rung, device_type="cpu")


def test_planner_keeps_quant_constants_whole_per_rank():
    """Per-rank 4-bit weights are half the packed bytes plus all of the quantisation constants."""
    shape = model_shape(json.loads((CONFIGS / "llama-3-70b.json").read_text()))
    cluster = Cluster(device="cuda", nodes=1, gpus_per_node=2, device_bytes=24 * GiB, host_ram_bytes=64 * GiB,
                      inter_link_gbit=1.0, tflops=40.0)
    request = default_request(method="qlora", data={"max_length": 1024}, train={"micro_batch_size": 1, "activation_checkpointing": True, "embedding_offload": False})  # one process would keep the table on the host, FSDP2 cannot
    one = estimate(shape, rung=option_rung("qlora", "no_shard", False, request=request, cluster=cluster), request=request, cluster=cluster)
    two = estimate(shape, rung=option_rung("qlora", "full_shard", False, request=request, cluster=cluster), request=request, cluster=cluster)
    states = quant_state_bytes(shape, request)
    assert 0.9 * GiB < states < 1.2 * GiB  # ~1/64 byte per weight with double quantisation
    assert two.memory.weights == pytest.approx((one.memory.weights - states) / 2 + states, abs=2)
    # loading holds one tensor per rank, never the model: far below the 37 GiB NF4 base
    offload = estimate(shape, rung=option_rung("qlora", "full_shard", True, request=request, cluster=cluster), request=request, cluster=cluster)
    assert offload.host_bytes < 64 * GiB


@pytest.mark.parametrize("quant_type, double_quant", [("nf4", True), ("fp4", False)])
def test_chunked_quantisation_is_bitsandbytes_bit_for_bit(monkeypatch, quant_type, double_quant):
    """Chunks of whole 64-value blocks, a short last block, and the double quantisation over the
    whole absmax: the same bytes and constants as one `quantize_4bit` call, and a forward (also
    bitsandbytes' single-token path) equal to the dequantised matmul."""
    bnb = pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as F

    from homelab_ft.model import quant

    monkeypatch.setattr(quant, "QUANT_CHUNK_VALUES", 1024)
    weight = torch.randn(72, 40, generator=torch.Generator().manual_seed(0))  # 2880 values: 3 chunks, 45 blocks
    packed, state = quant.quantize_4bit(weight, quant_type=quant_type, double_quant=double_quant,
                                                storage_dtype=torch.float32)
    ref, ref_state = F.quantize_4bit(weight, blocksize=64, compress_statistics=double_quant, quant_type=quant_type)
    assert packed.shape == (2880 // 8, 1) and packed.dtype == torch.float32
    assert torch.equal(packed.view(torch.uint8).reshape(-1), ref.reshape(-1))
    assert torch.equal(F.dequantize_4bit(packed, state), F.dequantize_4bit(ref, ref_state))
    dense = F.dequantize_4bit(ref, ref_state)
    with torch.no_grad():
        for x in (torch.randn(3, 5, 40), torch.randn(1, 1, 40)):
            assert torch.equal(bnb.matmul_4bit(x, packed, quant_state=state), x @ dense.t())
