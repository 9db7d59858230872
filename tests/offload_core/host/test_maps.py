"""MapsSnapshot on real loaders: which tensors are views of a file mapping and which are anonymous."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, load_file, save_file

from offload_core.host.maps import Backing, MapsSnapshot

SAMPLE = """\
00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/python3
01e0a000-01e2b000 rw-p 00000000 00:00 0           [heap]
7f0000000000-7f0000100000 r--p 00000000 fe:00 2148209    /models/dit.safetensors
7f0000100000-7f0000200000 rw-p 00000000 00:00 0
7f0000200000-7f0000300000 rw-s 00000000 00:01 1024       /dev/zero (deleted)
7f0000300000-7f0000400000 rw-s 00000000 00:01 77         /memfd:pinned (deleted)
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0           [stack]
"""


@pytest.fixture
def weights_file(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(256, 256), "b": torch.randn(300)}, str(path))
    return path


def test_bisect_lookup_classifies_each_region():
    snap = MapsSnapshot.parse(SAMPLE)
    assert snap.backing_of(0x7F0000000000) is Backing.FILE
    assert snap.backing_of(0x7F00000FFFFF) is Backing.FILE
    assert snap.region_of(0x7F0000080000).path == "/models/dit.safetensors"
    assert snap.backing_of(0x7F0000100000) is Backing.ANONYMOUS, "end is exclusive: next region"
    assert snap.backing_of(0x01E0A010) is Backing.ANONYMOUS  # [heap]
    assert snap.backing_of(0x7F0000200010) is Backing.ANONYMOUS, "/dev/zero is anonymous shared memory"
    assert snap.backing_of(0x7F0000300010) is Backing.ANONYMOUS, "a memfd is not a reclaimable file"
    assert snap.backing_of(0x10) is Backing.UNMAPPED
    assert snap.backing_of(0x7F0000400000) is Backing.UNMAPPED


def test_safe_open_and_load_file_give_views_of_the_file_mapping(weights_file):
    with safe_open(str(weights_file), framework="pt") as f:
        via_safe_open = f.get_tensor("a")
    via_load_file = load_file(str(weights_file))
    snap = MapsSnapshot.take()
    assert snap.tensor_backing(via_safe_open) is Backing.FILE
    assert snap.region_of(via_safe_open.data_ptr()).path == str(weights_file)
    assert all(snap.tensor_backing(t) is Backing.FILE for t in via_load_file.values())
    assert snap.mapped_bytes(via_load_file.values()) == 256 * 256 * 4 + 300 * 4


def test_loading_from_bytes_and_fresh_tensors_are_anonymous(weights_file):
    from_bytes = load(weights_file.read_bytes())
    fresh = torch.randn(512, 512)
    snap = MapsSnapshot.take()
    assert snap.tensor_backing(from_bytes["a"]) is Backing.ANONYMOUS
    assert snap.tensor_backing(fresh) is Backing.ANONYMOUS
    assert snap.mapped_bytes([fresh, from_bytes["a"]]) == 0


def test_a_copy_of_a_mapped_tensor_is_anonymous(weights_file):
    mapped = load_file(str(weights_file))["a"]
    copied = mapped.clone()
    snap = MapsSnapshot.take()
    assert snap.tensor_backing(mapped) is Backing.FILE
    assert snap.tensor_backing(copied) is Backing.ANONYMOUS


@pytest.mark.parametrize("shared", [True, False])
def test_torch_from_file_is_mapped(tmp_path, shared):
    path = tmp_path / "raw.bin"
    path.write_bytes(torch.arange(4096, dtype=torch.float32).numpy().tobytes())
    t = torch.from_file(str(path), shared=shared, size=4096, dtype=torch.float32)
    snap = MapsSnapshot.take()
    assert snap.tensor_backing(t) is Backing.FILE and snap.region_of(t.data_ptr()).path == str(path)
    assert torch.equal(t, torch.arange(4096, dtype=torch.float32))


def _tiny_wan(tmp_path):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32)
    model.save_pretrained(str(tmp_path / "wan"))
    return WanTransformer3DModel, tmp_path / "wan"


def test_diffusers_from_pretrained_keeps_weights_mapped_when_the_dtype_is_kept(tmp_path):
    cls, folder = _tiny_wan(tmp_path)
    model = cls.from_pretrained(str(folder))
    snap = MapsSnapshot.take()
    backings = {snap.tensor_backing(p) for p in model.parameters()}
    assert backings == {Backing.FILE}
    assert snap.region_of(model.blocks[0].attn1.to_q.weight.data_ptr()).path.endswith("diffusion_pytorch_model.safetensors")


def test_diffusers_from_pretrained_copies_weights_out_when_converting_dtype(tmp_path):
    cls, folder = _tiny_wan(tmp_path)
    model = cls.from_pretrained(str(folder), torch_dtype=torch.bfloat16)
    snap = MapsSnapshot.take()
    block_params = list(model.blocks.parameters())
    # Converted weights are fresh anonymous copies; only _keep_in_fp32_modules stay mapped.
    converted = [p for p in block_params if p.dtype == torch.bfloat16]
    assert converted and all(snap.tensor_backing(p) is Backing.ANONYMOUS for p in converted)


@pytest.mark.parametrize("dtype, expected", [(None, Backing.FILE), (torch.bfloat16, Backing.ANONYMOUS)])
def test_transformers_from_pretrained_maps_same_dtype_and_copies_converted(tmp_path, dtype, expected):
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    config = UMT5Config(vocab_size=1000, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    UMT5EncoderModel(config).save_pretrained(str(tmp_path / "enc"))
    kwargs = {} if dtype is None else {"dtype": dtype}
    model = UMT5EncoderModel.from_pretrained(str(tmp_path / "enc"), **kwargs)
    snap = MapsSnapshot.take()
    assert {snap.tensor_backing(p) for p in model.parameters()} == {expected}
