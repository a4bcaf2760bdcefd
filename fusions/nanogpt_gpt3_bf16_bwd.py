# backward fusion of nanogpt config gpt3 (bf16), traced by Thunder with nvtp's executor (nvtp 0.1.0, Thunder 0.2.6, torch 2.10.0+cu128).
# Regenerate: nvtp dump --model nanogpt --config gpt3 --dtype bf16 --out fusions
# Runs as is with nvfuser_direct on a CUDA GPU; `nvtp replay FILE --check` runs it anywhere.
import torch
from nvfuser_direct import FusionDefinition, DataType

nvtp_info = {
    "fusion": {"role": "backward", "model": "nanogpt", "config": "gpt3", "dtype": "bf16", "batch": "1", "seq_len": "2048", "n_embd": "12288", "n_head": "96", "dropout": "0.1", "forward": "nanogpt_gpt3_bf16_fwd.py"},
    "values": {
        "T0": {"role": "saved", "source": "T82"},
        "T1": {"role": "grad", "label": "grad(y)", "source": "T127"},
        "T2": {"role": "saved", "source": "T116"},
        "T3": {"role": "parameter", "label": "mlp.c_proj.weight"},
        "T4": {"role": "parameter", "label": "mlp.c_fc.weight"},
        "T5": {"role": "saved", "source": "T65"},
        "T6": {"role": "parameter", "label": "ln_2.weight"},
        "T7": {"role": "saved", "source": "T62"},
        "T8": {"role": "saved", "source": "T69"},
        "T9": {"role": "saved", "source": "T51"},
        "T10": {"role": "parameter", "label": "attn.c_proj.weight"},
        "T11": {"role": "saved", "source": "T32"},
        "T12": {"role": "saved", "source": "T42"},
        "T13": {"role": "saved", "source": "T43"},
        "T14": {"role": "saved", "source": "T44"},
        "T15": {"role": "saved", "source": "T45"},
        "T16": {"role": "parameter", "label": "attn.c_attn.weight"},
        "T17": {"role": "saved", "source": "T15"},
        "T18": {"role": "parameter", "label": "ln_1.weight"},
        "T19": {"role": "saved", "source": "T0"},
        "T20": {"role": "saved", "source": "T19"},
        "T21": {"role": "parameter", "label": "ln_1.bias"},
        "T22": {"role": "parameter", "label": "ln_2.bias"},
        "T309": {"role": "grad", "label": "grad(mlp.c_proj.weight)"},
        "T308": {"role": "grad", "label": "grad(mlp.c_proj.bias)"},
        "T307": {"role": "grad", "label": "grad(mlp.c_fc.weight)"},
        "T306": {"role": "grad", "label": "grad(mlp.c_fc.bias)"},
        "T305": {"role": "grad", "label": "grad(ln_2.bias)"},
        "T304": {"role": "grad", "label": "grad(ln_2.weight)"},
        "T303": {"role": "grad", "label": "grad(attn.c_proj.weight)"},
        "T302": {"role": "grad", "label": "grad(attn.c_proj.bias)"},
        "T301": {"role": "grad", "label": "grad(attn.c_attn.weight)"},
        "T300": {"role": "grad", "label": "grad(attn.c_attn.bias)"},
        "T299": {"role": "grad", "label": "grad(ln_1.bias)"},
        "T298": {"role": "grad", "label": "grad(ln_1.weight)"},
        "T297": {"role": "grad", "label": "grad(x)"},
    },
}

def nvfuser_fusion_id1(fd : FusionDefinition) -> None :
    T0 = fd.define_tensor(shape=[1, 2048, 49152], contiguity=[None, True, True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[2, 1, 0])  # saved (forward T82)
    T1 = fd.define_tensor(shape=[1, 2048, 12288], contiguity=[None, True, True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[2, 1, 0])  # grad grad(y) (forward T127)
    T2 = fd.define_tensor(shape=[1, 2048, 12288], contiguity=[None, True, True], dtype=DataType.Bool, is_cpu=False, stride_order=[2, 1, 0])  # saved (forward T116)
    T3 = fd.define_tensor(shape=[12288, 49152], contiguity=[True, True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[1, 0])  # parameter mlp.c_proj.weight
    T4 = fd.define_tensor(shape=[49152, 12288], contiguity=[True, True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[1, 0])  # parameter mlp.c_fc.weight
    T5 = fd.define_tensor(shape=[1, 2048], contiguity=[None, True], dtype=DataType.Float, is_cpu=False, stride_order=[1, 0])  # saved (forward T65)
    T6 = fd.define_tensor(shape=[12288], contiguity=[True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[0])  # parameter ln_2.weight
    T7 = fd.define_tensor(shape=[1, 2048, 12288], contiguity=[None, True, True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[2, 1, 0])  # saved (forward T62)
    T8 = fd.define_tensor(shape=[1, 2048, 1], contiguity=[None, True, None], dtype=DataType.Float, is_cpu=False, stride_order=[2, 1, 0])  # saved (forward T69)
    T9 = fd.define_tensor(shape=[1, 2048, 12288], contiguity=[None, True, True], dtype=DataType.Bool, is_cpu=False, stride_order=[2, 1, 0])  # saved (forward T51)
    T10 = fd.define_tensor(shape=[12288, 12288], contiguity=[True, True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[1, 0])  # parameter attn.c_proj.weight
    T11 = fd.define_tensor(shape=[1, 2048, 36864], contiguity=[None, True, True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[2, 1, 0])  # saved (forward T32)
    T12 = fd.define_tensor(shape=[1, 96, 2048, 128], contiguity=[None, True, True, True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[3, 2, 1, 0])  # saved (forward T42)
    T13 = fd.define_tensor(shape=[1, 96, 2048], contiguity=[None, True, True], dtype=DataType.Float, is_cpu=False, stride_order=[2, 1, 0])  # saved (forward T43)
    T14 = fd.define_tensor(shape=[2], contiguity=[True], dtype=DataType.UInt64, is_cpu=False, stride_order=[0])  # saved (forward T44)
    T15 = fd.define_tensor(shape=[], contiguity=[], dtype=DataType.UInt64, is_cpu=False, stride_order=[])  # saved (forward T45)
    T16 = fd.define_tensor(shape=[36864, 12288], contiguity=[True, True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[1, 0])  # parameter attn.c_attn.weight
    T17 = fd.define_tensor(shape=[1, 2048], contiguity=[None, True], dtype=DataType.Float, is_cpu=False, stride_order=[1, 0])  # saved (forward T15)
    T18 = fd.define_tensor(shape=[12288], contiguity=[True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[0])  # parameter ln_1.weight
    T19 = fd.define_tensor(shape=[1, 2048, 12288], contiguity=[None, True, True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[2, 1, 0])  # saved (forward T0)
    T20 = fd.define_tensor(shape=[1, 2048, 1], contiguity=[None, True, None], dtype=DataType.Float, is_cpu=False, stride_order=[2, 1, 0])  # saved (forward T19)
    T21 = fd.define_tensor(shape=[12288], contiguity=[True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[0])  # parameter ln_1.bias
    T22 = fd.define_tensor(shape=[12288], contiguity=[True], dtype=DataType.BFloat16, is_cpu=False, stride_order=[0])  # parameter ln_2.bias
    T23 = fd.ops.cast(T0, dtype=DataType.Float)
    T25 = fd.ops.mul(T23, T23)
    T26 = fd.ops.cast(T25, dtype=DataType.BFloat16)
    T29 = fd.ops.cast(T26, dtype=DataType.Float)
    T31 = fd.ops.mul(T29, T23)
    T32 = fd.ops.cast(T1, dtype=DataType.Float)
    T33 = fd.ops.cast(T31, dtype=DataType.BFloat16)
    T34 = fd.ops.mul(1.1111111111111112, T32)
    T35 = fd.ops.cast(T33, dtype=DataType.Float)
    T36 = fd.ops.cast(T34, dtype=DataType.BFloat16)
    T37 = fd.ops.mul(0.044715, T35)
    T38 = fd.ops.cast(T36, dtype=DataType.Float)
    T39 = fd.ops.cast(T2, dtype=DataType.Float)
    T40 = fd.ops.cast(T37, dtype=DataType.BFloat16)
    T41 = fd.ops.mul(T39, T38)
    T42 = fd.ops.cast(T40, dtype=DataType.Float)
    T44 = fd.ops.cast(T41, dtype=DataType.BFloat16)
    T45 = fd.ops.add(T23, T42)
    T46 = fd.ops.reshape(T44, new_shape=[2048, 12288])
    T48 = fd.ops.cast(T45, dtype=DataType.BFloat16)
    T49 = fd.ops.matmul(T46, T3)
    T50 = fd.ops.mul(0.5, T23)
    T51 = fd.ops.cast(T48, dtype=DataType.Float)
    T52 = fd.ops.reshape(T49, new_shape=[1, 2048, 49152])
    T53 = fd.ops.cast(T50, dtype=DataType.BFloat16)
    T54 = fd.ops.mul(0.7978845608028654, T51)
    T55 = fd.ops.cast(T52, dtype=DataType.Float)
    T56 = fd.ops.cast(T53, dtype=DataType.Float)
    T57 = fd.ops.cast(T54, dtype=DataType.BFloat16)
    T58 = fd.ops.mul(T56, T55)
    T59 = fd.ops.cast(T57, dtype=DataType.Float)
    T60 = fd.ops.cast(T58, dtype=DataType.BFloat16)
    T61 = fd.ops.tanh(T59)
    T63 = fd.ops.mul(T61, T61)
    T65 = fd.ops.sub(1.0, T63)
    T66 = fd.ops.cast(T60, dtype=DataType.Float)
    T67 = fd.ops.mul(T66, T65)
    T68 = fd.ops.cast(T61, dtype=DataType.BFloat16)
    T69 = fd.ops.cast(T67, dtype=DataType.BFloat16)
    T70 = fd.ops.cast(T68, dtype=DataType.Float)
    T71 = fd.ops.cast(T69, dtype=DataType.Float)
    T72 = fd.ops.add(1.0, T70)
    T73 = fd.ops.mul(0.7978845608028654, T71)
    T74 = fd.ops.cast(T72, dtype=DataType.BFloat16)
    T75 = fd.ops.cast(T73, dtype=DataType.BFloat16)
    T76 = fd.ops.cast(T74, dtype=DataType.Float)
    T78 = fd.ops.mul(T76, T55)
    T80 = fd.ops.cast(T78, dtype=DataType.BFloat16)
    T81 = fd.ops.cast(T75, dtype=DataType.Float)
    T82 = fd.ops.cast(T80, dtype=DataType.Float)
    T83 = fd.ops.mul(0.044715, T81)
    T84 = fd.ops.mul(0.5, T82)
    T85 = fd.ops.cast(T83, dtype=DataType.BFloat16)
    T86 = fd.ops.cast(T84, dtype=DataType.BFloat16)
    T88 = fd.ops.cast(T85, dtype=DataType.Float)
    T89 = fd.ops.cast(T86, dtype=DataType.Float)
    T91 = fd.ops.mul(T23, T88)
    T92 = fd.ops.mul(T29, T88)
    T93 = fd.ops.add(T81, T89)
    T94 = fd.ops.cast(T91, dtype=DataType.BFloat16)
    T95 = fd.ops.cast(T92, dtype=DataType.BFloat16)
    T96 = fd.ops.cast(T93, dtype=DataType.BFloat16)
    T97 = fd.ops.cast(T94, dtype=DataType.Float)
    T98 = fd.ops.cast(T95, dtype=DataType.Float)
    T99 = fd.ops.cast(T96, dtype=DataType.Float)
    T100 = fd.ops.mul(T23, T97)
    T101 = fd.ops.add(T99, T98)
    T102 = fd.ops.cast(T100, dtype=DataType.BFloat16)
    T103 = fd.ops.cast(T101, dtype=DataType.BFloat16)
    T104 = fd.ops.cast(T102, dtype=DataType.Float)
    T105 = fd.ops.cast(T103, dtype=DataType.Float)
    T107 = fd.ops.add(T105, T104)
    T109 = fd.ops.cast(T107, dtype=DataType.BFloat16)
    T111 = fd.ops.cast(T109, dtype=DataType.Float)
    T112 = fd.ops.add(T111, T104)
    T113 = fd.ops.cast(T112, dtype=DataType.BFloat16)
    T114 = fd.ops.reshape(T113, new_shape=[2048, 49152])
    T115 = fd.ops.matmul(T114, T4)
    T116 = fd.ops.broadcast_in_dim(T5, shape=[1, 2048, 1], broadcast_dims=[0, 1])
    T117 = fd.ops.reshape(T115, new_shape=[1, 2048, 12288])
    T118 = fd.ops.broadcast_in_dim(T6, shape=[1, 2048, 12288], broadcast_dims=[2])
    T119 = fd.ops.cast(T117, dtype=DataType.Float)
    T120 = fd.ops.cast(T118, dtype=DataType.Float)
    T121 = fd.ops.broadcast_in_dim(T116, shape=[1, 2048, 12288], broadcast_dims=[0, 1, 2])
    T122 = fd.ops.cast(T7, dtype=DataType.Float)
    T123 = fd.ops.mul(T120, T119)
    T124 = fd.ops.sub(T122, T121)
    T125 = fd.ops.mul(T124, T123)
    T126 = fd.ops.sum(T125, dims=[0, 2])
    T127 = fd.ops.broadcast_in_dim(T8, shape=[1, 2048, 12288], broadcast_dims=[0, 1, 2])
    T128 = fd.ops.mul(T127, T123)
    T129 = fd.ops.broadcast_in_dim(T126, shape=[1, 2048, 1], broadcast_dims=[1])
    T130 = fd.ops.neg(T128)
    T131 = fd.ops.pow(T8, 3.0)
    T132 = fd.ops.mul(-0.5, T129)
    T133 = fd.ops.mul(T132, T131)
    T134 = fd.ops.sum(T130, dims=[0, 2])
    T135 = fd.ops.sum(T133, dims=[0, 2])
    T136 = fd.ops.broadcast_in_dim(T134, shape=[1, 2048, 1], broadcast_dims=[1])
    T137 = fd.ops.broadcast_in_dim(T135, shape=[1, 2048], broadcast_dims=[1])
    T138 = fd.ops.sum(T136, dims=[0, 2])
    T141 = fd.ops.broadcast_in_dim(T137, shape=[1, 2048, 1], broadcast_dims=[0, 1])
    T143 = fd.ops.broadcast_in_dim(T141, shape=[1, 2048, 12288], broadcast_dims=[0, 1, 2])
    T144 = fd.ops.broadcast_in_dim(T138, shape=[1, 2048], broadcast_dims=[1])
    T146 = fd.ops.mul(2.0, T143)
    T147 = fd.ops.broadcast_in_dim(T144, shape=[1, 2048, 1], broadcast_dims=[0, 1])
    T148 = fd.ops.mul(T146, T124)
    T149 = fd.ops.broadcast_in_dim(T147, shape=[1, 2048, 12288], broadcast_dims=[0, 1, 2])
    T150 = fd.ops.cast(T128, dtype=DataType.BFloat16)
    T152 = fd.ops.div(T148, 12288.0)
    T153 = fd.ops.mul(8.138020833333333e-05, T149)
    T154 = fd.ops.cast(T150, dtype=DataType.Float)
    T156 = fd.ops.add(T153, T152)
    T157 = fd.ops.add(T32, T154)
    T158 = fd.ops.cast(T156, dtype=DataType.BFloat16)
    T159 = fd.ops.cast(T157, dtype=DataType.BFloat16)
    T160 = fd.ops.cast(T158, dtype=DataType.Float)
    T161 = fd.ops.cast(T159, dtype=DataType.Float)
    T162 = fd.ops.add(T161, T160)
    T163 = fd.ops.cast(T162, dtype=DataType.BFloat16)
    T166 = fd.ops.cast(T163, dtype=DataType.Float)
    T167 = fd.ops.mul(1.1111111111111112, T166)
    T168 = fd.ops.cast(T167, dtype=DataType.BFloat16)
    T169 = fd.ops.cast(T168, dtype=DataType.Float)
    T170 = fd.ops.cast(T9, dtype=DataType.Float)
    T171 = fd.ops.mul(T170, T169)
    T172 = fd.ops.cast(T171, dtype=DataType.BFloat16)
    T173 = fd.ops.reshape(T172, new_shape=[2048, 12288])
    T174 = fd.ops.matmul(T173, T10)
    T175 = fd.ops.slice(T11, start_indices=[0, 0, 24576], end_indices=[1, 2048, 36864], strides=[1, 1, 1])
    T176 = fd.ops.slice(T11, start_indices=[0, 0, 12288], end_indices=[1, 2048, 24576], strides=[1, 1, 1])
    T177 = fd.ops.slice(T11, start_indices=[0, 0, 0], end_indices=[1, 2048, 12288], strides=[1, 1, 1])
    T178 = fd.ops.reshape(T174, new_shape=[1, 2048, 12288])
    T179 = fd.ops.reshape(T175, new_shape=[1, 2048, 96, 128])
    T180 = fd.ops.reshape(T176, new_shape=[1, 2048, 96, 128])
    T181 = fd.ops.reshape(T177, new_shape=[1, 2048, 96, 128])
    T182 = fd.ops.reshape(T178, new_shape=[1, 2048, 96, 128])
    T183 = fd.ops.permute(T179, dims=[0, 2, 1, 3])
    T184 = fd.ops.permute(T180, dims=[0, 2, 1, 3])
    T185 = fd.ops.permute(T181, dims=[0, 2, 1, 3])
    T186 = fd.ops.permute(T182, dims=[0, 2, 1, 3])
    T187, T188, T189 = fd.ops.sdpfa_bwd(T186, T185, T184, T183, T12, T13, dropout_p=0.1, is_causal=True, philox_seed=T14, philox_offset=T15, scale=None)
    T190 = fd.ops.permute(T189, dims=[0, 2, 1, 3])
    T191 = fd.ops.permute(T188, dims=[0, 2, 1, 3])
    T192 = fd.ops.permute(T187, dims=[0, 2, 1, 3])
    T193 = fd.ops.reshape(T190, new_shape=[1, 2048, 12288])
    T194 = fd.ops.reshape(T191, new_shape=[1, 2048, 12288])
    T195 = fd.ops.reshape(T192, new_shape=[1, 2048, 12288])
    T196 = fd.ops.cat([T195, T194, T193], dim=2)
    T197 = fd.ops.reshape(T196, new_shape=[2048, 36864])
    T198 = fd.ops.matmul(T197, T16)
    T199 = fd.ops.broadcast_in_dim(T17, shape=[1, 2048, 1], broadcast_dims=[0, 1])
    T200 = fd.ops.reshape(T198, new_shape=[1, 2048, 12288])
    T201 = fd.ops.broadcast_in_dim(T18, shape=[1, 2048, 12288], broadcast_dims=[2])
    T202 = fd.ops.cast(T200, dtype=DataType.Float)
    T203 = fd.ops.cast(T201, dtype=DataType.Float)
    T204 = fd.ops.broadcast_in_dim(T199, shape=[1, 2048, 12288], broadcast_dims=[0, 1, 2])
    T205 = fd.ops.cast(T19, dtype=DataType.Float)
    T206 = fd.ops.mul(T203, T202)
    T207 = fd.ops.sub(T205, T204)
    T208 = fd.ops.mul(T207, T206)
    T209 = fd.ops.sum(T208, dims=[0, 2])
    T210 = fd.ops.broadcast_in_dim(T20, shape=[1, 2048, 12288], broadcast_dims=[0, 1, 2])
    T211 = fd.ops.mul(T210, T206)
    T212 = fd.ops.broadcast_in_dim(T209, shape=[1, 2048, 1], broadcast_dims=[1])
    T213 = fd.ops.neg(T211)
    T214 = fd.ops.pow(T20, 3.0)
    T215 = fd.ops.mul(-0.5, T212)
    T216 = fd.ops.mul(T215, T214)
    T217 = fd.ops.sum(T213, dims=[0, 2])
    T218 = fd.ops.sum(T216, dims=[0, 2])
    T219 = fd.ops.broadcast_in_dim(T217, shape=[1, 2048, 1], broadcast_dims=[1])
    T220 = fd.ops.broadcast_in_dim(T218, shape=[1, 2048], broadcast_dims=[1])
    T221 = fd.ops.sum(T219, dims=[0, 2])
    T224 = fd.ops.broadcast_in_dim(T220, shape=[1, 2048, 1], broadcast_dims=[0, 1])
    T226 = fd.ops.broadcast_in_dim(T224, shape=[1, 2048, 12288], broadcast_dims=[0, 1, 2])
    T227 = fd.ops.broadcast_in_dim(T221, shape=[1, 2048], broadcast_dims=[1])
    T229 = fd.ops.mul(2.0, T226)
    T230 = fd.ops.broadcast_in_dim(T227, shape=[1, 2048, 1], broadcast_dims=[0, 1])
    T231 = fd.ops.mul(T229, T207)
    T232 = fd.ops.broadcast_in_dim(T230, shape=[1, 2048, 12288], broadcast_dims=[0, 1, 2])
    T233 = fd.ops.cast(T211, dtype=DataType.BFloat16)
    T235 = fd.ops.div(T231, 12288.0)
    T236 = fd.ops.mul(8.138020833333333e-05, T232)
    T237 = fd.ops.cast(T233, dtype=DataType.Float)
    T239 = fd.ops.mul(T207, T210)
    T240 = fd.ops.broadcast_in_dim(T21, shape=[1, 2048, 12288], broadcast_dims=[2])
    T241 = fd.ops.mul(T124, T127)
    T242 = fd.ops.broadcast_in_dim(T22, shape=[1, 2048, 12288], broadcast_dims=[2])
    T243 = fd.ops.add(T236, T235)
    T244 = fd.ops.add(T166, T237)
    T245 = fd.ops.mul(T239, T202)
    T246 = fd.ops.cast(T240, dtype=DataType.Float)
    T247 = fd.ops.mul(T239, T203)
    T248 = fd.ops.permute(T12, dims=[0, 2, 1, 3])
    T249 = fd.ops.mul(T241, T119)
    T250 = fd.ops.cast(T242, dtype=DataType.Float)
    T251 = fd.ops.mul(T241, T120)
    T252 = fd.ops.cast(T243, dtype=DataType.BFloat16)
    T253 = fd.ops.cast(T244, dtype=DataType.BFloat16)
    T254 = fd.ops.cast(T245, dtype=DataType.BFloat16)
    T256 = fd.ops.add(T247, T246)
    T257 = fd.ops.stride_order(T248, stride_order=[3, 2, 1, 0])
    T258 = fd.ops.cast(T249, dtype=DataType.BFloat16)
    T260 = fd.ops.add(T251, T250)
    T261 = fd.ops.mul(T56, T76)
    T262 = fd.ops.cast(T252, dtype=DataType.Float)
    T263 = fd.ops.cast(T253, dtype=DataType.Float)
    T264 = fd.ops.cast(T254, dtype=DataType.Float)
    T266 = fd.ops.cast(T196, dtype=DataType.Float)
    T267 = fd.ops.cast(T256, dtype=DataType.BFloat16)
    T269 = fd.ops.cast(T172, dtype=DataType.Float)
    T270 = fd.ops.reshape(T257, new_shape=[1, 2048, 12288])
    T272 = fd.ops.cast(T258, dtype=DataType.Float)
    T274 = fd.ops.cast(T113, dtype=DataType.Float)
    T275 = fd.ops.cast(T260, dtype=DataType.BFloat16)
    T277 = fd.ops.cast(T44, dtype=DataType.Float)
    T278 = fd.ops.cast(T261, dtype=DataType.BFloat16)
    T280 = fd.ops.add(T263, T262)
    T281 = fd.ops.sum(T264, dims=[0, 1])
    T282 = fd.ops.sum(T202, dims=[0, 1])
    T283 = fd.ops.sum(T266, dims=[0, 1])
    T284 = fd.ops.reshape(T267, new_shape=[2048, 12288])
    T285 = fd.ops.permute(T197, dims=[1, 0])
    T286 = fd.ops.sum(T269, dims=[0, 1])
    T287 = fd.ops.reshape(T270, new_shape=[2048, 12288])
    T288 = fd.ops.permute(T173, dims=[1, 0])
    T289 = fd.ops.sum(T272, dims=[0, 1])
    T290 = fd.ops.sum(T119, dims=[0, 1])
    T291 = fd.ops.sum(T274, dims=[0, 1])
    T292 = fd.ops.reshape(T275, new_shape=[2048, 12288])
    T293 = fd.ops.permute(T114, dims=[1, 0])
    T294 = fd.ops.sum(T277, dims=[0, 1])
    T295 = fd.ops.reshape(T278, new_shape=[2048, 49152])
    T296 = fd.ops.permute(T46, dims=[1, 0])
    T297 = fd.ops.cast(T280, dtype=DataType.BFloat16)  # grad grad(x)
    T298 = fd.ops.cast(T281, dtype=DataType.BFloat16)  # grad grad(ln_1.weight)
    T299 = fd.ops.cast(T282, dtype=DataType.BFloat16)  # grad grad(ln_1.bias)
    T300 = fd.ops.cast(T283, dtype=DataType.BFloat16)  # grad grad(attn.c_attn.bias)
    T301 = fd.ops.matmul(T285, T284)  # grad grad(attn.c_attn.weight)
    T302 = fd.ops.cast(T286, dtype=DataType.BFloat16)  # grad grad(attn.c_proj.bias)
    T303 = fd.ops.matmul(T288, T287)  # grad grad(attn.c_proj.weight)
    T304 = fd.ops.cast(T289, dtype=DataType.BFloat16)  # grad grad(ln_2.weight)
    T305 = fd.ops.cast(T290, dtype=DataType.BFloat16)  # grad grad(ln_2.bias)
    T306 = fd.ops.cast(T291, dtype=DataType.BFloat16)  # grad grad(mlp.c_fc.bias)
    T307 = fd.ops.matmul(T293, T292)  # grad grad(mlp.c_fc.weight)
    T308 = fd.ops.cast(T294, dtype=DataType.BFloat16)  # grad grad(mlp.c_proj.bias)
    T309 = fd.ops.matmul(T296, T295)  # grad grad(mlp.c_proj.weight)
    fd.add_output(T309)
    fd.add_output(T308)
    fd.add_output(T307)
    fd.add_output(T306)
    fd.add_output(T305)
    fd.add_output(T304)
    fd.add_output(T303)
    fd.add_output(T302)
    fd.add_output(T301)
    fd.add_output(T300)
    fd.add_output(T299)
    fd.add_output(T298)
    fd.add_output(T297)

with FusionDefinition() as fd:
    nvfuser_fusion_id1(fd)

inputs = [
    torch.testing.make_tensor((1, 2048, 49152), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((1, 2048, 12288), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((1, 2048, 12288), dtype=torch.bool, device='cuda:0'),
    torch.testing.make_tensor((12288, 49152), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((49152, 12288), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((1, 2048), dtype=torch.float32, device='cuda:0'),
    torch.testing.make_tensor((12288,), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((1, 2048, 12288), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((1, 2048, 1), dtype=torch.float32, device='cuda:0'),
    torch.testing.make_tensor((1, 2048, 12288), dtype=torch.bool, device='cuda:0'),
    torch.testing.make_tensor((12288, 12288), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((1, 2048, 36864), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((1, 96, 2048, 128), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((1, 96, 2048), dtype=torch.float32, device='cuda:0'),
    torch.testing.make_tensor((2,), dtype=torch.uint64, device='cuda:0'),
    torch.testing.make_tensor((), dtype=torch.uint64, device='cuda:0'),
    torch.testing.make_tensor((36864, 12288), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((1, 2048), dtype=torch.float32, device='cuda:0'),
    torch.testing.make_tensor((12288,), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((1, 2048, 12288), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((1, 2048, 1), dtype=torch.float32, device='cuda:0'),
    torch.testing.make_tensor((12288,), dtype=torch.bfloat16, device='cuda:0'),
    torch.testing.make_tensor((12288,), dtype=torch.bfloat16, device='cuda:0'),
]
fd.execute(inputs)
