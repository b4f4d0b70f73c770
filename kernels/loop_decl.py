"""The GPU-resident loop's host-visible structs, declared once: its counters, the control block, the
build options, the sampling extensions' tables and the arguments every kernel reads, with the named
error codes of its library. `python -m protocols.layout.gen` writes `kernels/loop_layout.py` (ctypes,
used by `kernels/persistent_loop.py`) and `kernels/csrc/include/blink_loop_layout.h` (included by
`blink_loop.cuh`). Writers: "host" (before the launch), "loop" (the kernels), "create" (blink_loop_create).
"""
from protocols.layout import Const, Enum, Field, Layout, Struct

MAX_EOS = 8  # BLINK_SCHED_MAX_EOS (kernels/sched_decl.py)

_COUNTERS = tuple(Field(name, "uint64_t", writer="loop", doc=doc) for name, doc in (
    ("iterations", "loop kernel runs"),
    ("steps", "model steps"),
    ("tokens", "tokens published"),
    ("busy_ns", "sum over back-to-back steps of commit-to-commit time"),
    ("busy_steps", ""),
    ("sched_ns", "sum over steps of the loop kernel's time (commit, admission, schedule, fill)"),
    ("idle_polls", ""),
    ("commit_ns", "parts of sched_ns: copy-in + applying the sampled tokens,"),
    ("schedule_ns", "ring poll + admission + scheduling (of the last attempt),"),
    ("fill_ns", "step buffer fill + picking the graph"),
    ("spec_hits", "steps whose speculation was taken"),
    ("spec_misses", "speculations dropped (a stop token, new requests, a preemption, nothing to run)"),
    ("spec_ns", "the spec kernel's time (beside the bucket graph)"),
    ("gap_ns", "sum over taken speculations: the graph's tokens seen -> the next step's kernels start"),
    ("gap_steps", ""),
))

_CTL = (
    Field("stop", "uint32_t", writer="host", doc="1 = fail what is in flight, leave the loop"),
    Field("exited", "uint32_t", writer="loop", doc="1 once the last iteration ran"),
    Field("c", "blink_loop_counters", writer="loop", doc="mirrored from the loop's own copy"),
    Field("error", "uint32_t", writer="loop", doc="blink_loop_fault: why the loop stopped on its own"),
)

_OPTIONS = (  # defaults and environment variables: kernels/persistent_loop.py, LoopOptions
    Field("smem", "uint32_t", doc="the scheduler's hot state in shared memory when it fits (0: global)"),
    Field("spec_tail_check", "uint32_t", doc="requests queued after the speculation looked drop it"),
    Field("async_take", "uint32_t", doc="the take kernel launches the next step before the tokens come"),
    Field("spec_priority", "uint32_t", doc="publish, spec and take kernels at the greatest node priority"),
    Field("side_root", "uint32_t", doc="publish -> spec as a root of the bucket graph, not after its first node"),
    Field("plain_edges", "uint32_t", doc="the model graph's programmatic edges made plain (bench build)"),
    Field("stamps", "uint32_t", doc="stamp kernels after the model's nodes (bench build)"),
    Field("spinner_ns", "uint64_t", doc="a block holding an SM this long beside the graph, 0: none (bench build)"),
    Field("spec_at", "double", doc="publish -> spec after the node at this fraction of the model graph; <0: its first"),
)

_EXT = (
    Field("logits", "float*", writer="host", doc="[S, V] float32: the LOGITS graphs' output, adjusted in place"),
    Field("scratch", "uint32_t*", writer="host", doc="[S, V] zero between steps"),
    Field("lp_chosen", "const float*", writer="host", doc="[2, S] per step buffer: the logprob of each row's token"),
    Field("lp_ids", "const int32_t*", writer="host", doc="[2, S, lp_k] its best lp_k alternatives, descending"),
    Field("lp_vals", "const float*", writer="host", doc="[2, S, lp_k]"),
    Field("post_graphs", "void* const*", writer="host",
          doc="host memory: [8 * num_buckets] cudaGraph_t, twice the plain branches' order: "
              "the POST graphs with the logprobs, then without"),
    Field("flags", "uint32_t*", writer="host", doc="[N] per slot, at admission: BLINK_EXT_* bits"),
    Field("num_logprobs", "int32_t*", writer="host", doc="[N]"),
    Field("prompt_len", "int32_t*", writer="host", doc="[N]"),
    Field("num_bias", "int32_t*", writer="host", doc="[N]"),
    Field("capacity", "int32_t*", writer="host", doc="[N] tokens the slot may run ahead of the gateway's reads"),
    Field("penalties", "float*", writer="host", doc="[N, 3] presence, frequency, repetition"),
    Field("bias_ids", "int32_t*", writer="host", doc="[N, max_bias]"),
    Field("bias_vals", "float*", writer="host", doc="[N, max_bias]"),
    Field("row_slot", "int32_t*", writer="host", doc="[2, S] sampled row -> slot when it uses an extension, else -1"),
    Field("slot_row", "int32_t*", writer="host", doc="[2, N] per step buffer: slot -> its sampled row"),
    *(Field(n, "uint64_t", writer="host", doc=d) for n, d in (
        ("bias_offset", "the ring's logit-bias areas"), ("bias_bytes", ""), ("lp_offset", "its logprob areas"),
        ("lp_bytes", ""), ("lp_ids_offset", ""), ("lp_top_offset", ""),
        ("off_sample_rows", "step buffer fields (input_ids at 0)"), ("off_seq_ids", ""), ("off_sample_pos", ""))),
    *(Field(n, "uint32_t", writer="host") for n in ("vocab", "max_rows", "lp_k", "max_bias", "window",
                                                     "max_logprobs", "num_buckets", "context_len")),
    Field("num_rows", "uint32_t", 2, writer="loop", doc="sampled rows of the step in buffer b"),
    Field("extended", "uint32_t", 2, writer="loop", doc="that step runs its extended branch: 1 with the logprobs, 2 without (0: its plain one)"),
    Field("pub_buf", "uint32_t", writer="loop", doc="the buffer of the step whose tokens the next publish writes"),
    Field("mask_state", "int32_t*", writer="host",
          doc="[2, S] per sampled row of a masked slot: 0, TOKEN_WAIT or TOKEN_MASK_EMPTY (blink_ext_adjust)"),
    *(Field(n, "uint64_t", writer="host", doc=d) for n, d in (
        ("masks_offset", "the ring's token-mask areas (version 3)"), ("mask_bytes", ""), ("mask_seq_offset", ""))),
    Field("mask_words", "uint32_t", writer="host", doc="0: the ring carries no masks"),
    Field("masked", "uint32_t", 2, writer="loop", doc="1: a row of the step in buffer b samples under a token mask"),
)

_ARGS = (
    Field("ring", "uint8_t*", writer="host", doc="device address of the ring"),
    *(Field(n, "uint64_t", writer="host") for n in ("sq_offset", "requests_offset", "responses_offset",
                                                     "request_bytes", "response_bytes", "prompt_offset")),
    *(Field(n, "uint32_t", writer="host") for n in ("num_slots", "max_prompt_len", "max_output_len", "max_stop_ids")),
    # admission's checks (blink_admit.h): the rest of the geometry and the vocabulary, never read from the ring
    *(Field(n, "uint64_t", writer="host") for n in ("bias_offset", "bias_bytes")),
    *(Field(n, "uint32_t", writer="host") for n in ("max_logit_bias", "max_logprobs", "vocab")),
    Field("sched_mem", "uint8_t*", writer="host", doc="blink_sched state (device)"),
    Field("hot_bytes", "uint64_t", writer="create", doc="its hot prefix (blink_sched_bind_split)"),
    Field("smem_bytes", "uint32_t", writer="create", doc="0: the hot prefix does not fit in shared memory"),
    Field("step_buf", "uint8_t*", writer="host", doc="step_buffers.StepBuffers.dev"),
    Field("sampled", "int64_t*", writer="host", doc="gpu_runner.tokens_dev: the graphs' sampled tokens (-1: not yet)"),
    Field("sampled32", "int32_t*", writer="host", doc="[max_seqs] scratch"),
    Field("slot_seq", "uint64_t*", writer="host", doc="[num_slots] the request seq a slot serves"),
    Field("slot_produced", "uint32_t*", writer="host", doc="[num_slots] tokens published (the response's produced)"),
    Field("room", "int32_t*", writer="host", doc="[num_slots] scratch (when not in shared memory)"),
    Field("order", "int32_t*", writer="host", doc="[num_slots] scratch of blink_sched_schedule (idem)"),
    Field("cancel", "uint8_t*", writer="host", doc="[num_slots] scratch (idem)"),
    Field("par", "int32_t*", writer="host", doc="[5 * num_slots] scratch of blink_sched_par.cuh (idem)"),
    Field("ctl", "blink_loop_ctl*", writer="host", doc="device address of the mapped control block"),
    Field("full_exec", "cudaGraphExec_t", writer="create", doc="the full step's graph, launchable from the device"),
    Field("branch_execs", "cudaGraphExec_t*", writer="create", doc="[num_branches] the bucket graphs' (device)"),
    Field("num_branches", "uint32_t", writer="create"),
    Field("check_tail", "uint32_t", writer="create", doc="1: new requests queued after the speculation looked drop it"),
    Field("clock_offset_ns", "int64_t", writer="host", doc="CLOCK_MONOTONIC = %globaltimer + offset"),
    Field("sq_head", "uint64_t", writer="loop", doc="the loop's own words from here (device memory)"),
    *(Field(n, "uint64_t", writer="loop") for n in ("beats", "generated", "last_commit_ns")),
    Field("ready_ns", "uint64_t", writer="loop", doc="a taken speculation's tokens seen (for the gap counter)"),
    Field("take_wait_ns", "uint64_t", writer="loop", doc="the take kernel's last wait for tokens"),
    Field("c", "blink_loop_counters", writer="loop"),
    Field("step_buf_alt", "uint8_t*", writer="host", doc="the step buffer of the branches b = 1 (step_buf: b = 0)"),
    Field("hot_alt", "uint8_t*", writer="create", doc="the second copy of the scheduler's hot prefix"),
    Field("tokens", "int32_t*", writer="create", doc="the scheduler's token history (cold, shared by both copies)"),
    Field("stop_ids", "int32_t*", writer="create", doc="its stop ids (cold, shared)"),
    Field("rows", "spec_row*", writer="create", doc="[max_seqs] per sampled row of the running step (spec kernel)"),
    Field("err_slot", "int32_t*", writer="create", doc="[num_slots] admission errors the speculation found (deferred)"),
    Field("err_code", "int32_t*", writer="create"),
    Field("new_token_offset", "uint64_t", writer="create", doc="new_token's byte offset in a hot copy"),
    Field("sq_head_alt", "uint64_t", writer="loop", doc="the speculated state's submission head"),
    Field("spec_tail", "uint64_t", writer="loop", doc="the submission tail the speculation saw"),
    Field("cur", "uint32_t", writer="loop", doc="which hot copy is the real state (0: sched_mem, 1: hot_alt)"),
    Field("buf", "uint32_t", writer="loop", doc="the step buffer of the step that runs now"),
    Field("spec_ok", "uint32_t", writer="loop", doc="1: the other copy holds step n+1, filled into the other buffer"),
    Field("spec_branch", "uint32_t", writer="loop", doc="its bucket graph (branch_of)"),
    Field("spec_rows", "uint32_t", writer="loop", doc="sampled rows of the running step"),
    Field("num_err", "uint32_t", writer="loop", doc="deferred admission errors, published with the accepted step"),
    Field("exiting", "uint32_t", writer="loop", doc="the loop is ending: nothing more to speculate"),
    Field("num_eos", "uint32_t", writer="create"),
    Field("spec_done", "uint32_t", writer="loop", doc="1: the spec kernel of this iteration is done"),
    Field("async_take", "uint32_t", writer="create", doc="1: blink_loop_take launches the next step before its tokens"),
    Field("eos_ids", "int32_t", MAX_EOS, writer="create"),
    Field("ext", "blink_loop_ext*", writer="host", doc="the sampling extensions (blink_loop_ext.cuh), 0: off"),
    Field("hash_offset", "uint64_t", writer="host", doc="ring version 3: the block-hash areas"),
    Field("hash_bytes", "uint64_t", writer="host"),
    Field("max_block_hashes", "uint32_t", writer="host", doc="per slot"),
)

LOOP_ERRORS = (  # (NAME, message): what blink_loop_* returns as code * 1000 + cudaError_t
    ("OK", "no error"),
    ("CUDA", "a CUDA call failed"),
    ("NEEDS_BENCH_BUILD", "the options ask for benchmark probes, which only the bench build has "
                          "(kernels.persistent_loop.load(bench=True))"),
    ("STREAM", "creating the loop's stream or graph"),
    ("HOST_ALLOC", "allocating host memory for the graph handles"),
    ("SCHED_STATE", "reading the scheduler's header from device memory"),
    ("SHARED_MEMORY", "querying or raising the kernels' shared memory"),
    ("SPEC_BUFFERS", "allocating the speculation's buffers"),
    ("EXT", "reading the sampling extensions' arguments (args->ext)"),
    ("BRANCH_COUNT", "num_branches does not match the buckets (and extensions), or there is no second step buffer"),
    ("ARGS_UPLOAD", "copying the arguments to device memory"),
    ("STEP_NODE", "adding the full step's kernel"),
    ("BRANCH_GRAPH", "building a bucket graph's branch (its child graph, take, publish and spec kernels)"),
    ("PRIORITY", "setting the side kernels' node priority"),
    ("PROBES", "adding a benchmark probe"),
    ("INSTANTIATE", "instantiating a graph for device launch"),
    ("UPLOAD", "uploading a graph or its handles"),
)

LAYOUT = Layout(
    name="loop",
    py_out="kernels/loop_layout.py",
    c_out="kernels/csrc/include/blink_loop_layout.h",
    doc="The GPU-resident loop's structs shared with the host (kernels/csrc/persistent_loop.cu).",
    c_prelude=("", "#include <cuda_runtime.h>", "", "struct spec_row;  // blink_loop.cuh: the loop's own"),
    items=(
        Const("MAX_EOS", "BLINK_LOOP_MAX_EOS", MAX_EOS, "eos_ids entries (BLINK_SCHED_MAX_EOS)"),
        Enum("blink_loop_error", "LoopError", "BLINK_LOOP_E_", tuple((n, i, m) for i, (n, m) in enumerate(LOOP_ERRORS)),
             doc="Where a blink_loop_* call failed: returned as code * 1000 + the cudaError_t", messages=True),
        Enum("blink_loop_fault", "LoopFault", "BLINK_LOOP_FAULT_", (
            ("NONE", 0, "the loop stopped when asked"),
            ("NO_BUCKET_GRAPH", 1, "a step needed a bucket the loop has no graph for"),
            ("GRAPH_LAUNCH", 2, "a device graph launch failed")),
            doc="Why the loop stopped on its own (blink_loop_ctl.error)", messages=True),
        Struct("blink_loop_counters", _COUNTERS, ctypes_name="LoopCounters"),
        Struct("blink_loop_ctl", _CTL, ctypes_name="LoopCtl", anonymous=("c",),
               doc="pinned, mapped: the host writes stop only, the loop stores the rest (a read of host memory "
                   "is a PCIe round trip, so the loop keeps its counters in device memory and mirrors them)"),
        Struct("blink_loop_options", _OPTIONS, ctypes_name="LoopOptionsStruct",
               doc="how blink_loop_create builds the loop (host memory, read once)"),
        Struct("blink_loop_ext", _EXT, ctypes_name="LoopExt",
               doc="the sampling extensions (blink_loop_ext.cuh): device memory, set by the engine"),
        Struct("blink_loop_args", _ARGS, ctypes_name="LoopArgs",
               doc="everything the kernels need, in device memory (written once by the host before the launch)"),
    ),
)
