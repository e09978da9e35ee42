"""hlo_stats.scheduled_overlap: what the kernels a compiled schedule puts between an
asynchronous collective's start and its done hide of it."""

import pytest

from hloplan.hlo_stats import collective_stats, compiled_kernels, scheduled_overlap

# A scheduled per-device module in libtpu's forms: a collective-permute-start/done pair, an
# all-gather run as an AsyncCollectiveStart / AsyncCollectiveDone pair of fusions (same
# channel), and a synchronous all-reduce. Kernel k1 runs while both are in flight, k2 while
# only the all-gather is, k3 after both.
HLO = """\
HloModule m, is_scheduled=true, num_partitions=8

%start_comp (p0: bf16[32,64]) -> (bf16[32,64], bf16[64,64], u32[]) {
  %p0 = bf16[32,64]{1,0} parameter(0)
  %all-gather.1 = bf16[64,64]{1,0} all-gather(%p0), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  ROOT %cc.1 = (bf16[32,64]{1,0}, bf16[64,64]{1,0}, u32[]{:S(2)}) custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}

%done_comp (q0: bf16[32,64], q1: bf16[64,64], q2: u32[]) -> bf16[64,64] {
  %q0 = bf16[32,64]{1,0} parameter(0)
  %q1 = bf16[64,64]{1,0} parameter(1)
  %q2 = u32[]{:S(2)} parameter(2)
  %all-gather.2 = bf16[64,64]{1,0} all-gather(%q0), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  ROOT %cc.2 = bf16[64,64]{1,0} custom-call(%q0, %q1, %all-gather.2, %q2), custom_call_target="AsyncCollectiveDone"
}

%neg_comp (n0: f32[256]) -> f32[256] {
  %n0 = f32[256]{0} parameter(0)
  ROOT %n1 = f32[256]{0} negate(%n0)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: bf16[32,64], g: f32[256]) -> (bf16[64,64], f32[256], f32[256]) {
  %x = bf16[32,64]{1,0} parameter(0)
  %g = f32[256]{0} parameter(1)
  %cp-start = (f32[256]{0}, f32[256]{0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%g), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}
  %start = (bf16[32,64]{1,0}, bf16[64,64]{1,0}, u32[]{:S(2)}) fusion(%x), kind=kCustom, calls=%start_comp
  %k1 = f32[256]{0} fusion(%g), kind=kLoop, calls=%neg_comp
  %cp-done = f32[256]{0} collective-permute-done(%cp-start)
  %k2 = f32[256]{0} fusion(%k1), kind=kLoop, calls=%neg_comp
  %gte0 = bf16[32,64]{1,0} get-tuple-element(%start), index=0
  %gte1 = bf16[64,64]{1,0} get-tuple-element(%start), index=1
  %gte2 = u32[]{:S(2)} get-tuple-element(%start), index=2
  %done = bf16[64,64]{1,0} fusion(%gte0, %gte1, %gte2), kind=kCustom, calls=%done_comp
  %k3 = f32[256]{0} fusion(%k2), kind=kLoop, calls=%neg_comp
  %ar = f32[256]{0} all-reduce(%k3), channel_id=4, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  ROOT %out = (bf16[64,64]{1,0}, f32[256]{0}, f32[256]{0}) tuple(%done, %cp-done, %ar)
}
"""

KERNELS = {"k1": 3.0, "k2": 5.0, "k3": 7.0}


def test_the_names_are_collective_stats_and_compiled_kernels_names():
    names = {op.name for op in collective_stats(HLO, mesh_axes=[("x", 2), ("y", 4)]).ops}
    assert names == {"cp-start", "all-gather.1", "ar"}
    assert set(KERNELS) <= {k.name for k in compiled_kernels(HLO)}


def test_kernels_between_start_and_done_are_shared_among_the_collectives_in_flight():
    hidden = scheduled_overlap(HLO, KERNELS, {"cp-start": 4.0, "all-gather.1": 10.0, "ar": 2.0})
    # k1 runs while both are in flight: half of its 3 s hides each.
    assert hidden["cp-start"] == pytest.approx(1.5)
    assert hidden["all-gather.1"] == pytest.approx(1.5 + 5.0)
    # Synchronous: nothing runs beside it.
    assert hidden["ar"] == 0.0


def test_a_collective_is_hidden_at_most_whole():
    hidden = scheduled_overlap(HLO, KERNELS, {"cp-start": 1.0, "all-gather.1": 2.0})
    assert hidden == {"cp-start": 1.0, "all-gather.1": 2.0}


def test_collectives_not_asked_for_share_nothing():
    # Only the all-gather is priced: k1 hides it alone.
    hidden = scheduled_overlap(HLO, KERNELS, {"all-gather.1": 10.0})
    assert hidden["all-gather.1"] == pytest.approx(3.0 + 5.0)


def test_a_done_in_another_computation_hides_nothing():
    # The start's done is missing from its computation (a loop carrying it): not counted.
    text = HLO.replace("  %cp-done = f32[256]{0} collective-permute-done(%cp-start)\n", "")
    text = text.replace("tuple(%done, %cp-done, %ar)", "tuple(%done, %k1, %ar)")
    hidden = scheduled_overlap(text, KERNELS, {"cp-start": 4.0, "all-gather.1": 10.0})
    assert hidden["cp-start"] == 0.0
    assert hidden["all-gather.1"] == pytest.approx(3.0 + 5.0)
