"""The Python half of nf4_interop_test.sh: bitsandbytes 0.50's NF4 of a few tensors, for
fsdp to match bit for bit.

    nf4_interop.py OUT.safetensors

For each case NAME (dtypes, a short last block, an odd element count, more than 256
blocks, an all-zero block) it writes NAME.x (the input), and for double quantization
(compress_statistics=True) and without it (prefix "plain_"): codes (uint8, flat), absmax,
nested_absmax, nested_code and offset (double only), and dequantized (dequantize_4bit of
those bytes in x's shape; see dequantized()), all from bitsandbytes.quantize_4bit(x,
blocksize=64, quant_type="nf4").
"""
import sys

import torch
from bitsandbytes import functional as F
from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
from bitsandbytes.backends.utils import _get_4bit_code
from safetensors.torch import save_file

CASES = {
    "bf16_40x96": (torch.bfloat16, (40, 96)),
    "fp16_7x33": (torch.float16, (7, 33)),  # 231 elements: odd, a short last block
    "fp32_300": (torch.float32, (300,)),
    "bf16_600x64": (torch.bfloat16, (600, 64)),  # 600 blocks: 3 nested blocks
    "bf16_zero_block": (torch.bfloat16, (4, 64)),
}


def dequantized(codes, state, x):
    """bitsandbytes' dequantize_4bit of these bytes, in x's shape. Its native CPU kernel
    restarts the blocks at each row when the last dimension is not a multiple of the
    blocksize, unlike its quantizer's layout and its CUDA and reference kernels: such a
    tensor takes the reference kernel's values (the absmax still bitsandbytes')."""
    out = F.dequantize_4bit(codes, state).reshape(x.shape)
    if x.shape[-1] % state.blocksize == 0:
        return out.contiguous()
    absmax = state.absmax
    if state.nested:
        absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
    reference = _dequantize_4bit_compute(codes.reshape(-1), absmax.float(),
                                         _get_4bit_code("nf4", "cpu"), state.blocksize,
                                         tuple(x.shape), x.dtype)
    return reference.contiguous()


def main():
    torch.manual_seed(0)
    tensors = {}
    for name, (dtype, shape) in CASES.items():
        x = (torch.randn(shape) * 0.05).to(dtype)
        if name == "bf16_zero_block":
            x[1].zero_()
        tensors[f"{name}.x"] = x
        for prefix, nested in (("", True), ("plain_", False)):
            codes, state = F.quantize_4bit(x, blocksize=64, quant_type="nf4",
                                           compress_statistics=nested)
            tensors[f"{name}.{prefix}codes"] = codes.reshape(-1).contiguous()
            tensors[f"{name}.{prefix}absmax"] = state.absmax.contiguous()
            if nested:
                tensors[f"{name}.nested_absmax"] = state.state2.absmax.contiguous()
                tensors[f"{name}.nested_code"] = state.state2.code.contiguous()
                tensors[f"{name}.offset"] = state.offset.reshape(1).float()
                assert state.state2.blocksize == 256, state.state2.blocksize
            tensors[f"{name}.{prefix}dequantized"] = dequantized(codes, state, x)
    save_file(tensors, sys.argv[1])


if __name__ == "__main__":
    main()
