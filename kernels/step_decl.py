"""The step buffer the bucket graphs read, declared once: one byte buffer of arrays over T tokens, S rows
and MB blocks per sequence, each 8-byte aligned, in this order (a step copies only the prefix it uses: the
block tables come last). `python -m protocols.layout.gen` writes `kernels/step_layout.py` (used by
`gpu_backend/engine/step_buffers.py`) and `kernels/csrc/include/blink_step_layout.h` (the C fill in
`blink_sched.h` and `blink_sched_par.cuh`). Written by the fill (host or loop), read by the graphs.
"""
from protocols.layout import Array, ArrayBlock, Layout

LAYOUT = Layout(
    name="step",
    py_out="kernels/step_layout.py",
    c_out="kernels/csrc/include/blink_step_layout.h",
    doc="The step buffer: one step's inputs for the bucket graphs (gpu_backend/engine/step_buffers.py).",
    items=(
        ArrayBlock("STEP", dims=("T", "S", "MB"), enum_prefix="BLINK_F_", doc="one step's inputs", arrays=(
            Array("input_ids", "int32_t", ("T",)),
            Array("positions", "int64_t", ("T",)),
            Array("slot_mapping", "int64_t", ("T",), doc="KV cache slot of each token, -1: padding"),
            Array("seq_ids", "int32_t", ("T",), doc="the token's row, -1: padding"),
            Array("sample_rows", "int64_t", ("S",), doc="the token row each sampled row samples from"),
            Array("temperature", "float", ("S",)),
            Array("top_k", "int32_t", ("S",)),
            Array("top_p", "float", ("S",)),
            Array("min_p", "float", ("S",)),
            Array("seeds", "int64_t", ("S",), doc="u64 seeds, stored bitwise"),
            Array("sample_pos", "int64_t", ("S",), doc="the sampled token's position (the RNG's counter)"),
            Array("q_start", "int32_t", ("S+1",), doc="each row's first token"),
            Array("ctx_lens", "int32_t", ("S",)),
            Array("num_seqs", "int32_t", (1,)),
            Array("block_tables", "int32_t", ("S", "MB")),
        )),
    ),
)
