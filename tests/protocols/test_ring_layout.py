"""The C view of the ring (kernels/csrc/include/blink_ring.h) agrees with protocols/ring.py, byte for byte."""
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from protocols import ring as R

HEADER = Path(__file__).resolve().parents[2] / "kernels" / "csrc" / "include" / "blink_ring.h"
GEOMETRIES = [R.RingGeometry(), R.RingGeometry(num_slots=3, max_prompt_len=17, max_output_len=5, max_stop_ids=3,
                                               max_logit_bias=7, max_logprobs=3, logprob_window=4, mask_words=5,
                                               kv_block_size=4),
              R.RingGeometry(num_slots=2, mask_words=4008)]

STRUCTS = {"blink_ring_header": R.HEADER_FIELDS, "blink_request_slot": R.REQUEST_FIELDS,
           "blink_response_slot": R.RESPONSE_FIELDS}


def _c_program() -> str:
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "blink_ring.h"', "int main(void) {", 'printf("{");']
    for struct, fields in STRUCTS.items():
        for name in fields:
            lines.append(f'printf("\\"{struct}.{name}\\": %zu, ", offsetof({struct}, {name}));')
        lines.append(f'printf("\\"{struct}.sizeof\\": %zu, ", sizeof({struct}));')
    for i, g in enumerate(GEOMETRIES):
        lines.append(f'printf("\\"g{i}.request_bytes\\": %llu, ", (unsigned long long)blink_request_bytes({g.max_stop_ids}, {g.max_prompt_len}));')
        lines.append(f'printf("\\"g{i}.prompt_offset\\": %llu, ", (unsigned long long)blink_prompt_offset({g.max_stop_ids}));')
        lines.append(f'printf("\\"g{i}.response_bytes\\": %llu, ", (unsigned long long)blink_response_bytes({g.max_output_len}));')
        lines.append(f'printf("\\"g{i}.requests_offset\\": %llu, ", (unsigned long long)blink_requests_offset({g.num_slots}));')
        lines.append(f'printf("\\"g{i}.logit_bias_bytes\\": %llu, ", (unsigned long long)blink_logit_bias_bytes({g.max_logit_bias}));')
        lines.append(f'printf("\\"g{i}.logprob_bytes\\": %llu, ", (unsigned long long)blink_logprob_bytes({g.logprob_window}, {g.max_logprobs}));')
        lines.append(f'printf("\\"g{i}.logprob_top_ids_offset\\": %llu, ", (unsigned long long)blink_logprob_top_ids_offset({g.logprob_window}));')
        lines.append(f'printf("\\"g{i}.logprob_top_offset\\": %llu, ", (unsigned long long)blink_logprob_top_offset({g.logprob_window}, {g.max_logprobs}));')
        lines.append(f'{{ blink_ring_header h = {{0}}; h.num_slots = {g.num_slots}; h.max_logit_bias = {g.max_logit_bias}; '
                     f'h.logit_bias_offset = {g.logit_bias_offset}; '
                     f'printf("\\"g{i}.logprobs_offset\\": %llu, ", (unsigned long long)blink_logprobs_offset(&h)); '
                     f'h.logprob_window = {g.logprob_window}; h.max_logprobs = {g.max_logprobs}; '
                     f'printf("\\"g{i}.block_hashes_offset\\": %llu, ", (unsigned long long)blink_block_hashes_offset(&h)); '
                     f'h.max_prompt_len = {g.max_prompt_len}; h.kv_block_size = {g.kv_block_size}; '
                     f'printf("\\"g{i}.masks_offset\\": %llu, ", (unsigned long long)blink_masks_offset(&h)); }}')
        lines.append(f'printf("\\"g{i}.mask_bytes\\": %llu, ", (unsigned long long)blink_mask_bytes({g.mask_words}));')
        lines.append(f'printf("\\"g{i}.mask_seq_offset\\": %llu, ", (unsigned long long)blink_mask_seq_offset({g.mask_words}));')
    lines += ['printf("\\"magic\\": %llu, \\"version\\": %u}", (unsigned long long)BLINK_RING_MAGIC, BLINK_RING_VERSION);',
              "return 0; }"]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler on PATH: the layout check needs one (apt-get install gcc)")
    tmp = tmp_path_factory.mktemp("ringc")
    (tmp / "layout.c").write_text(_c_program())
    subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-I", str(HEADER.parent), "-o", str(tmp / "layout"),
                    str(tmp / "layout.c")], check=True)
    return json.loads(subprocess.run([str(tmp / "layout")], check=True, capture_output=True, text=True).stdout)


def test_every_field_offset_matches(c_layout):
    for struct, fields in STRUCTS.items():
        for name, (offset, _ctype) in fields.items():
            assert c_layout[f"{struct}.{name}"] == offset, f"{struct}.{name}"


def test_struct_sizes_match(c_layout):
    assert c_layout["blink_ring_header.sizeof"] == R.HEADER_BYTES
    assert c_layout["blink_request_slot.sizeof"] == R.REQ_STOP_IDS
    assert c_layout["blink_response_slot.sizeof"] == R.RESP_TOKENS


def test_geometry_derived_sizes_match(c_layout):
    for i, g in enumerate(GEOMETRIES):
        assert c_layout[f"g{i}.request_bytes"] == g.request_bytes
        assert c_layout[f"g{i}.prompt_offset"] == g.prompt_offset
        assert c_layout[f"g{i}.response_bytes"] == g.response_bytes
        assert c_layout[f"g{i}.requests_offset"] == g.requests_offset
        assert c_layout[f"g{i}.logit_bias_bytes"] == g.logit_bias_bytes
        assert c_layout[f"g{i}.logprob_bytes"] == g.logprob_bytes
        assert c_layout[f"g{i}.logprob_top_ids_offset"] == g.logprob_top_ids_offset
        assert c_layout[f"g{i}.logprob_top_offset"] == g.logprob_top_offset
        assert c_layout[f"g{i}.logprobs_offset"] == g.logprobs_offset
        assert c_layout[f"g{i}.block_hashes_offset"] == g.block_hashes_offset
        assert c_layout[f"g{i}.masks_offset"] == g.masks_offset
        assert c_layout[f"g{i}.mask_bytes"] == g.mask_bytes
        assert c_layout[f"g{i}.mask_seq_offset"] == g.mask_seq_offset


def test_version_1_offsets_did_not_move():
    """The GPU loop reads these through blink_ring.h: version 2 only filled padding and appended regions."""
    v1 = {"seq": 0, "request_id": 8, "prompt_len": 16, "max_tokens": 20, "temperature": 24, "top_p": 28,
          "top_k": 32, "min_p": 36, "seed": 40, "flags": 48, "priority": 52, "num_stop_ids": 56,
          "cancel_seq": 64, "stop_ids": 128}
    assert {k: R.REQUEST_FIELDS[k][0] for k in v1} == v1
    assert (R.RESP_PRODUCED, R.RESP_FINISH_REASON, R.RESP_CONSUMED, R.RESP_TOKENS) == (8, 12, 64, 128)
    g = R.RingGeometry()
    assert (g.request_bytes, g.response_bytes, g.responses_offset) == (32960, 4224, 1280 + 256 * 32960)


def test_magic_and_version_match(c_layout):
    assert c_layout["magic"] == R.RING_MAGIC
    assert c_layout["version"] == R.RING_VERSION


def test_every_ring_field_names_its_one_writer():
    from protocols.layout import Struct
    from protocols.ring_decl import LAYOUT

    for struct in (i for i in LAYOUT.items if isinstance(i, Struct)):
        for f in struct.fields:
            assert f.writer in ("creator", "engine", "gateway"), f"{struct.c_name}.{f.name}: writer {f.writer!r}"


def test_the_request_head_is_the_slot_bytes_the_producer_writes():
    """One struct format, derived from the declaration, for the shm producer's write and the tcp Submit."""
    assert R.REQUEST_HEAD.format == "<QIIffifQIIIxxxxQfffIII"
    assert R.REQUEST_HEAD.size == R.REQ_NUM_BLOCK_HASHES + 4 - R.REQ_REQUEST_ID
    spec = R.RequestSpec(request_id=7, prompt_ids=(1, 2, 3), max_tokens=9, temperature=0.5, seed=11, stop_ids=(4,),
                         presence_penalty=0.25, logit_bias=((5, 1.5),), num_logprobs=2, priority=1,
                         block_hashes=(2**64 - 1, 5))
    head = R.REQUEST_HEAD.unpack(R.REQUEST_HEAD.pack(*R.request_head(spec)))
    assert dict(zip(R.REQUEST_HEAD_NAMES, head))["num_block_hashes"] == 2
    assert R.spec_from_head(head, spec.prompt_ids, spec.stop_ids, spec.logit_bias,
                            block_hashes=spec.block_hashes) == spec
    assert dict(zip(R.REQUEST_HEAD_NAMES, head))["cancel_seq"] == 0  # written as 0 with a new request


def test_header_fields_read_and_write_through_the_generated_dtype():
    import numpy as np

    g = R.RingGeometry(num_slots=3, max_prompt_len=17, max_output_len=5, max_stop_ids=3)
    buf = np.zeros(g.total_bytes, dtype=np.uint8)
    R.write_header(buf, g, "fp-1")
    assert R.geometry_from_header(buf) == g and R.read_fingerprint(buf) == "fp-1"
    assert int(buf[R.HDR_REQUEST_BYTES:R.HDR_REQUEST_BYTES + 4].view(np.uint32)[0]) == g.request_bytes
