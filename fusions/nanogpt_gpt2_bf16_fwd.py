# forward fusion of nanogpt config gpt2 (bf16), traced by Thunder with nvtp's executor (nvtp 0.1.0, Thunder 0.2.6, torch 2.10.0+cu128).
# Regenerate: nvtp dump --model nanogpt --config gpt2 --dtype bf16 --out fusions
# Runs as is with nvfuser_direct on a CUDA GPU; `nvtp replay FILE --check` runs it anywhere.
import torch
from nvfuser_direct import FusionDefinition, DataType

nvtp_info = {
    "fusion": {"role": "forward", "model": "nanogpt", "config": "gpt2", "dtype": "bf16", "batch": "1", "seq_len": "1024", "n_embd": "768", "n_head": "12", "dropout": "0.1", "backward": "nanogpt_gpt2_bf16_bwd.py"},
    "values": {
        "T0": {"role": "activation", "label": "x"},
        "T1": {"role": "parameter", "label": "ln_1.weight"},
        "T2": {"role": "parameter", "label": "ln_1.bias"},
        "T3": {"role": "parameter", "label": "attn.c_attn.weight"},
        "T4": {"role": "parameter", "label": "attn.c_attn.bias"},
        "T5": {"role": "parameter", "label": "attn.c_proj.weight"},
        "T6": {"role": "parameter", "label": "attn.c_proj.bias"},
        "T7": {"role": "parameter", "label": "ln_2.weight"},
        "T8": {"role": "parameter", "label": "ln_2.bias"},
        "T9": {"role": "parameter", "label": "mlp.c_fc.weight"},
        "T10": {"role": "parameter", "label": "mlp.c_fc.bias"},
        "T11": {"role": "parameter", "label": "mlp.c_proj.weight"},
        "T12": {"role": "parameter", "label": "mlp.c_proj.bias"},
        "T15": {"role": "saved"},
        "T19": {"role": "saved"},
        "T32": {"role": "saved"},
        "T42": {"role": "saved"},
        "T43": {"role": "saved"},
        "T44": {"role": "saved"},
        "T45": {"role": "saved"},
        "T51": {"role": "saved"},
        "T62": {"role": "saved"},
        "T65": {"role": "saved"},
        "T69": {"role": "saved"},
        "T82": {"role": "saved"},
        "T116": {"role": "saved"},
        "T127": {"role": "output", "label": "y"},
    },
}

def nvfuser_fusion_id0(fd : FusionDefinition) -> None :
    T0 = fd.define_tensor(shape=[1, 1024, 768], contiguity=[None, True, True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[2, 1, 0])  # activation x
    T1 = fd.define_tensor(shape=[768], contiguity=[True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[0])  # parameter ln_1.weight
    T2 = fd.define_tensor(shape=[768], contiguity=[True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[0])  # parameter ln_1.bias
    T3 = fd.define_tensor(shape=[2304, 768], contiguity=[True, True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[1, 0])  # parameter attn.c_attn.weight
    T4 = fd.define_tensor(shape=[2304], contiguity=[True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[0])  # parameter attn.c_attn.bias
    T5 = fd.define_tensor(shape=[768, 768], contiguity=[True, True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[1, 0])  # parameter attn.c_proj.weight
    T6 = fd.define_tensor(shape=[768], contiguity=[True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[0])  # parameter attn.c_proj.bias
    T7 = fd.define_tensor(shape=[768], contiguity=[True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[0])  # parameter ln_2.weight
    T8 = fd.define_tensor(shape=[768], contiguity=[True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[0])  # parameter ln_2.bias
    T9 = fd.define_tensor(shape=[3072, 768], contiguity=[True, True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[1, 0])  # parameter mlp.c_fc.weight
    T10 = fd.define_tensor(shape=[3072], contiguity=[True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[0])  # parameter mlp.c_fc.bias
    T11 = fd.define_tensor(shape=[768, 3072], contiguity=[True, True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[1, 0])  # parameter mlp.c_proj.weight
    T12 = fd.define_tensor(shape=[768], contiguity=[True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[0])  # parameter mlp.c_proj.bias
    T13 = fd.ops.cast(T0, dtype=DataType.Float)
    T14, T15 = fd.ops.var_mean(T13, dims=[2], correction=0)
    T16 = fd.ops.broadcast_in_dim(T14, shape=[1, 1024, 1], broadcast_dims=[0, 1])
    T17 = fd.ops.broadcast_in_dim(T15, shape=[1, 1024, 1], broadcast_dims=[0, 1])
    T18 = fd.ops.add(T16, 1e-05)
    T19 = fd.ops.rsqrt(T18)  # saved
    T20 = fd.ops.broadcast_in_dim(T17, shape=[1, 1024, 768], broadcast_dims=[0, 1, 2])
    T22 = fd.ops.sub(T13, T20)
    T23 = fd.ops.broadcast_in_dim(T19, shape=[1, 1024, 768], broadcast_dims=[0, 1, 2])
    T24 = fd.ops.mul(T22, T23)
    T25 = fd.ops.broadcast_in_dim(T1, shape=[1, 1024, 768], broadcast_dims=[2])
    T26 = fd.ops.cast(T25, dtype=DataType.Float)
    T27 = fd.ops.mul(T24, T26)
    T28 = fd.ops.broadcast_in_dim(T2, shape=[1, 1024, 768], broadcast_dims=[2])
    T29 = fd.ops.cast(T28, dtype=DataType.Float)
    T30 = fd.ops.add(T27, T29)
    T31 = fd.ops.cast(T30, dtype=DataType.BFloat16)
    T32 = fd.ops.linear(T31, T3, bias=T4)  # saved
    T33 = fd.ops.slice(T32, start_indices=[0, 0, 0], end_indices=[1, 1024, 768], strides=[1, 1, 1])
    T34 = fd.ops.slice(T32, start_indices=[0, 0, 768], end_indices=[1, 1024, 1536], strides=[1, 1, 1])
    T35 = fd.ops.slice(T32, start_indices=[0, 0, 1536], end_indices=[1, 1024, 2304], strides=[1, 1, 1])
    T36 = fd.ops.reshape(T33, new_shape=[1, 1024, 12, 64])
    T37 = fd.ops.permute(T36, dims=[0, 2, 1, 3])
    T38 = fd.ops.reshape(T34, new_shape=[1, 1024, 12, 64])
    T39 = fd.ops.permute(T38, dims=[0, 2, 1, 3])
    T40 = fd.ops.reshape(T35, new_shape=[1, 1024, 12, 64])
    T41 = fd.ops.permute(T40, dims=[0, 2, 1, 3])
    T42, T43, T44, T45 = fd.ops.sdpfa_fwd(T37, T39, T41, dropout_p=0.1, is_causal=True)  # saved
    T46 = fd.ops.permute(T42, dims=[0, 2, 1, 3])
    T47 = fd.ops.stride_order(T46, stride_order=[3, 2, 1, 0])
    T48 = fd.ops.reshape(T47, new_shape=[1, 1024, 768])
    T49 = fd.ops.linear(T48, T5, bias=T6)
    T50 = fd.ops.uniform(0.0, 1.0, shape=[1, 1024, 768], dtype=DataType.BFloat16)
    T51 = fd.ops.lt(T50, 0.9)  # saved
    T52 = fd.ops.cast(T49, dtype=DataType.Float)
    T53 = fd.ops.cast(T51, dtype=DataType.Float)
    T54 = fd.ops.mul(T52, T53)
    T55 = fd.ops.cast(T54, dtype=DataType.BFloat16)
    T56 = fd.ops.cast(T55, dtype=DataType.Float)
    T57 = fd.ops.mul(T56, 1.1111111111111112)
    T58 = fd.ops.cast(T57, dtype=DataType.BFloat16)
    T60 = fd.ops.cast(T58, dtype=DataType.Float)
    T61 = fd.ops.add(T13, T60)
    T62 = fd.ops.cast(T61, dtype=DataType.BFloat16)  # saved
    T63 = fd.ops.cast(T62, dtype=DataType.Float)
    T64, T65 = fd.ops.var_mean(T63, dims=[2], correction=0)
    T66 = fd.ops.broadcast_in_dim(T64, shape=[1, 1024, 1], broadcast_dims=[0, 1])
    T67 = fd.ops.broadcast_in_dim(T65, shape=[1, 1024, 1], broadcast_dims=[0, 1])
    T68 = fd.ops.add(T66, 1e-05)
    T69 = fd.ops.rsqrt(T68)  # saved
    T70 = fd.ops.broadcast_in_dim(T67, shape=[1, 1024, 768], broadcast_dims=[0, 1, 2])
    T72 = fd.ops.sub(T63, T70)
    T73 = fd.ops.broadcast_in_dim(T69, shape=[1, 1024, 768], broadcast_dims=[0, 1, 2])
    T74 = fd.ops.mul(T72, T73)
    T75 = fd.ops.broadcast_in_dim(T7, shape=[1, 1024, 768], broadcast_dims=[2])
    T76 = fd.ops.cast(T75, dtype=DataType.Float)
    T77 = fd.ops.mul(T74, T76)
    T78 = fd.ops.broadcast_in_dim(T8, shape=[1, 1024, 768], broadcast_dims=[2])
    T79 = fd.ops.cast(T78, dtype=DataType.Float)
    T80 = fd.ops.add(T77, T79)
    T81 = fd.ops.cast(T80, dtype=DataType.BFloat16)
    T82 = fd.ops.linear(T81, T9, bias=T10)  # saved
    T83 = fd.ops.cast(T82, dtype=DataType.Float)
    T85 = fd.ops.mul(T83, T83)
    T86 = fd.ops.cast(T85, dtype=DataType.BFloat16)
    T87 = fd.ops.cast(T86, dtype=DataType.Float)
    T89 = fd.ops.mul(T87, T83)
    T90 = fd.ops.cast(T89, dtype=DataType.BFloat16)
    T92 = fd.ops.mul(0.5, T83)
    T93 = fd.ops.cast(T92, dtype=DataType.BFloat16)
    T94 = fd.ops.cast(T90, dtype=DataType.Float)
    T95 = fd.ops.mul(0.044715, T94)
    T96 = fd.ops.cast(T95, dtype=DataType.BFloat16)
    T98 = fd.ops.cast(T96, dtype=DataType.Float)
    T99 = fd.ops.add(T83, T98)
    T100 = fd.ops.cast(T99, dtype=DataType.BFloat16)
    T101 = fd.ops.cast(T100, dtype=DataType.Float)
    T102 = fd.ops.mul(0.7978845608028654, T101)
    T103 = fd.ops.cast(T102, dtype=DataType.BFloat16)
    T104 = fd.ops.cast(T103, dtype=DataType.Float)
    T105 = fd.ops.tanh(T104)
    T106 = fd.ops.cast(T105, dtype=DataType.BFloat16)
    T107 = fd.ops.cast(T106, dtype=DataType.Float)
    T108 = fd.ops.add(1.0, T107)
    T109 = fd.ops.cast(T108, dtype=DataType.BFloat16)
    T110 = fd.ops.cast(T93, dtype=DataType.Float)
    T111 = fd.ops.cast(T109, dtype=DataType.Float)
    T112 = fd.ops.mul(T110, T111)
    T113 = fd.ops.cast(T112, dtype=DataType.BFloat16)
    T114 = fd.ops.linear(T113, T11, bias=T12)
    T115 = fd.ops.uniform(0.0, 1.0, shape=[1, 1024, 768], dtype=DataType.BFloat16)
    T116 = fd.ops.lt(T115, 0.9)  # saved
    T117 = fd.ops.cast(T114, dtype=DataType.Float)
    T118 = fd.ops.cast(T116, dtype=DataType.Float)
    T119 = fd.ops.mul(T117, T118)
    T120 = fd.ops.cast(T119, dtype=DataType.BFloat16)
    T121 = fd.ops.cast(T120, dtype=DataType.Float)
    T122 = fd.ops.mul(T121, 1.1111111111111112)
    T123 = fd.ops.cast(T122, dtype=DataType.BFloat16)
    T125 = fd.ops.cast(T123, dtype=DataType.Float)
    T126 = fd.ops.add(T63, T125)
    T127 = fd.ops.cast(T126, dtype=DataType.BFloat16)  # output y
    fd.add_output(T15)
    fd.add_output(T19)
    fd.add_output(T32)
    fd.add_output(T42)
    fd.add_output(T43)
    fd.add_output(T44)
    fd.add_output(T45)
    fd.add_output(T51)
    fd.add_output(T62)
    fd.add_output(T65)
    fd.add_output(T69)
    fd.add_output(T82)
    fd.add_output(T116)
    fd.add_output(T127)

with FusionDefinition() as fd:
    nvfuser_fusion_id0(fd)

inputs = [
    torch.testing.make_tensor((1, 1024, 768), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((768,), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((768,), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((2304, 768), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((2304,), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((768, 768), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((768,), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((768,), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((768,), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((3072, 768), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((3072,), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((768, 3072), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((768,), dtype=torch.bfloat16, device='cuda:0'),
]
fd.execute(inputs)
