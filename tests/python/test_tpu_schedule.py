"""The static speed estimate's reader of libtpu's dumps (mhc.tpu._schedule, issue 42 item 4) on a
fixed sample in the dumps' format: a grid loop with an inner loop of 19 trips and a predicated
region (a forward branch, not a loop), so every count below follows from the sample by hand. The
compile that produces real dumps is in test_tpu_compile.py (slow)."""

import pytest

from mhc.tpu import _schedule

# Addresses 0x0-0xa. The grid loop is region 7 (0x2-0x9, 34 trips: the exit test); inside it the
# inner loop, region 9 (0x4-0x5, 19 trips), and a predicated region 11 that 0x3 branches forward to.
BUNDLES = """= control target key start
LH: loop header
LB: loop body
= control target key end

     0   :  { %s0 = inlined_call_operand.hbm [shape: bf16[64,4,256], index: 0, kind: input] /* window
pad_low: (0, 0, 0)
second_minor_factor: 1 */  ;;  %s1 = smov 0 } /* entry bundle: %k = custom-call() */
   0x1   :  { %s2 = smov 0 } /* Start region 5 */
   0x2 LB: > { %s3 = sphi %s2, %s9  ;;  %v1 = vld [vmem:[%s0]] } /* Start region 7 */
   0x3   : > { %p1 = scmp.eq.s32.totalorder %s3, 0  ;;  %4 = sbr.rel (%p1) target = $region11 }
   0x4 LB: >> { %v2 = vadd.f32 %v1, %v1  ;;  %5 = vst [vmem:[#allocation3_spill]] %v2 } /* Start region 9 */
   0x5   : >> { %p2 = scmp.ge.s32.totalorder %s5, 19 /* loop exit test */  ;;  %6 = sbr.rel (!%p2) target = $region9 }
   0x6 PB: > { %v3 = vmul.f32 %v1, %v1 } /* Start region 11 */
   0x7   : > { %v4 = vld [vmem:[#allocation3_spill]] } /* End region 11 */
   0x8   : > { %s9 = sadd.s32 1, %s3  ;;  %p3 = scmp.ge.s32.totalorder %s9, 34 /* loop exit test */ }
   0x9   : > { %7 = sbr.rel (!%p3) target = $region7 }
   0xa   :  { %8 = vsyncpa [#allocation4], 1 } /* exit bundle */
"""

# Per bundle: MXU VALU VLOAD VLOAD:FILL VSTORE VSTORE:SPILL (slots used), in address order.
UTILIZATION = """== CAPACTIY:
MXU, VALU, VLOAD, VLOAD:FILL, VSTORE, VSTORE:SPILL
    4     4     3     3     1     1
== UTILIZATION:
0 0 0 0 0 0
0 0 0 0 0 0
0 0 1 0 0 0
0 0 0 0 0 0
0 2 0 0 1 1
0 0 0 0 0 0
0 4 0 0 0 0
0 0 1 1 0 0
0 0 0 0 0 0
0 0 0 0 0 0
0 0 0 0 0 0
"""


def test_parse_bundles_reads_one_bundle_per_address_with_its_comment_lines():
    bundles = _schedule.parse_bundles(BUNDLES)
    assert len(bundles) == 11
    assert "second_minor_factor" in bundles[0] and "entry bundle" in bundles[0]
    assert "vsyncpa" in bundles[10]


def test_find_loops_takes_backward_branches_with_their_exit_tests_and_skips_forward_ones():
    loops = _schedule.find_loops(_schedule.parse_bundles(BUNDLES))
    assert sorted(loops, key=lambda loop: loop.first) == [
        _schedule.Loop(first=2, last=9, trips=34),
        _schedule.Loop(first=4, last=5, trips=19),
    ]
    # A branch without a predicate is read the same way.
    unconditional = BUNDLES.replace("sbr.rel (!%p3) target = $region7", "sbr.rel target = $region7")
    assert _schedule.Loop(first=2, last=9, trips=34) in _schedule.find_loops(_schedule.parse_bundles(unconditional))


def test_an_unrolled_loop_counts_its_trips_by_its_step_and_start():
    # libtpu's form of a fori_loop unrolled by 2: the counter steps by 2 from an smov to the exit
    # test's bound (the post forward's bf16 kernel: 64 rows of 8 tokens, 32 trips).
    stepped = BUNDLES.replace("%p2 = scmp.ge.s32.totalorder %s5, 19", "%p2 = scmp.ge.s32.totalorder %s5, 64").replace(
        "%v2 = vadd.f32 %v1, %v1", "%v2 = vadd.f32 %v1, %v1  ;;  %s4 = sphi %s10, %s5  ;;  %s5 = sadd.s32 2, %s4"
    )
    stepped = stepped.replace("%s2 = smov 0", "%s2 = smov 0  ;;  %s10 = smov 6")
    loops = _schedule.find_loops(_schedule.parse_bundles(stepped))
    assert _schedule.Loop(first=4, last=5, trips=29) in loops  # (64 - 6) / 2


def test_step_schedule_expands_the_inner_loop_by_its_trips():
    step = _schedule.step_schedule(BUNDLES, UTILIZATION)
    # 0x2-0x9 is 8 bundles, of which the inner loop's 2 run 19 times: 6 + 2 * 19.
    assert step.bundles == 6 + 2 * 19
    assert step.loop_trips == 34 and step.unknown_trips == 0
    assert step.spill_stores == 19  # the inner loop's spill, once per trip
    assert step.fills == 1
    assert step.units["VALU"] == 2 * 19 + 4
    assert step.units["VLOAD"] == 1 + 1
    # VALU: 42 of 4 x 44 slots; VSTORE 19 of 44; the spill column is not a unit of its own.
    assert step.busiest(2) == [("VSTORE", pytest.approx(19 / 44)), ("VALU", pytest.approx(42 / (4 * 44)))]


def test_estimate_is_bundles_times_grid_over_the_clock():
    step = _schedule.step_schedule(BUNDLES, UTILIZATION)
    clock = _schedule.CHIPS["v5e"]["clock_hz"]
    assert clock == pytest.approx(1.503e9, rel=1e-3)
    assert _schedule.estimate_us(step, 32, "v5e") == pytest.approx(44 * 32 / clock * 1e6)
    assert _schedule.floor_us(819e9, "v5e") == pytest.approx(1e6)


def test_an_inner_loop_without_a_constant_trip_count_is_counted_once_and_reported():
    dynamic = BUNDLES.replace("%s5, 19 /* loop exit test */", "%s5, %s6")
    step = _schedule.step_schedule(dynamic, UTILIZATION)
    assert step.bundles == 8 and step.unknown_trips == 1


def test_mismatched_dumps_raise_naming_the_function():
    with pytest.raises(ValueError, match=r"step_schedule: 3 utilization rows for 11 bundles"):
        _schedule.step_schedule(BUNDLES, "\n".join(UTILIZATION.splitlines()[:7]))
    with pytest.raises(ValueError, match=r"parse_utilization: a row without one value per unit"):
        _schedule.parse_utilization(UTILIZATION.replace("0 4 0 0 0 0", "0 4 0 0"))
    with pytest.raises(ValueError, match=r"step_schedule: the bundles have no loop"):
        straight = BUNDLES.replace("target = $region7", "target = $region12").replace("$region9", "$region12")
        _schedule.step_schedule(straight, UTILIZATION)


def test_bench_tpu_estimate_runs_the_compile_script_with_its_arguments(capfd):
    # python -m mhc.bench --tpu-estimate hands the rest to mhc.tpu.compile_report --estimate: an
    # unknown kernel is that script's own error (nothing is compiled).
    from mhc import bench

    assert bench.main(["--tpu-estimate", "--kernels", "mhc_no_such_kernel"]) == 2
    assert "--kernels: ['mhc_no_such_kernel'] not in mhc.tpu.KERNELS" in capfd.readouterr().err


# A pl.when on the last grid axis (the post backward's first-chunk step, lines as libtpu 0.0.42.1
# wrote them for v5e, operands shortened): the grid loop 0x2-0xb (34 trips), its chunk index the phi
# libtpu annotates "iter bound = 1" (grid axis 1), spilled to SMEM and loaded back, compared with 0;
# the branch at 0x6 skips 0x7-0x9 where the index is not 0, to a region libtpu labels "Start/End
# empty region" (the reader before this sample took it for an unknown label and counted 0x7-0x9 at
# every step).
WHEN_BUNDLES = """= control target key start
LH: loop header
LB: loop body
PB: predicated region body
PF: predicated region fallthrough
= control target key end

     0   :  { %s2_s12 = smov 0 /* copy for cssa */  ;;  %s3_s30 = smov 0 /* copy for cssa */ }
   0x1   :  { %17 = vsyncpa [#allocation5], 0 } /* Start region 1 */
   0x2 LB: > { %s31_s12 = sadd.s32 1, %s20_s12  ;;  %s20_s12 = sphi %s2_s12, %s31_s12 /* phi copy :: iteration index, stage = 0 :: iteration index, stage = 0 */  ;;  %s28_s30 = sphi %s3_s30, %s40_s30 /* phi copy :: iteration index, stage = 1 iter bound = 1 :: iteration index, stage = 1 iter bound = 1 */ } /* Start region 7 */
   0x3   : > { %400498 = sst [smem:[#allocation17_spill]] %s28_s30  ;;  %s40_s30 = sadd.s32 1, %s28_s30 }
   0x4   : > { %s467557_s7 = sld [smem:[#allocation17_spill]] }
   0x5   : > { %p198723_p5 = scmp.ne.s32.totalorder %s467557_s7, 0 }
   0x6   : > { %v1_v1 = vadd.f32 %v0_v0, %v0_v0  ;;  %196838 = sbr.rel (%p198723_p5) target = $region56 }
   0x7   : > { %196968 = vst.msk [vmem:[%s200291_s27 + $0x1f8] sm:$0xff] /*vm=*/%vm196904_vm2, /*vst_source=*/%v1_v1 } /* Start region 55 */
   0x8   : > { %5 = vst [vmem:[#allocation3_spill]] %v1_v1 }
   0x9   : > { %v2_v2 = vmul.f32 %v1_v1, %v1_v1 } /* End region 55 */
   0xa PF: > { %v196969_v28 = vld [vmem:[%s200285_s22] sm:$0xff] } /* Start/End empty region 56 */
   0xb   : > { %p28_p13 = scmp.ge.s32.totalorder %s31_s12, 34 /* loop exit test */  ;;  %7 = sbr.rel (!%p28_p13) target = $region7 }
   0xc   :  { %8 = vsyncpa [#allocation4], 1 } /* exit bundle */
"""  # noqa: E501 (libtpu's lines)

# VALU, VSTORE, VSTORE:SPILL per bundle.
WHEN_UTILIZATION = """== CAPACTIY:
VALU, VSTORE, VSTORE:SPILL
    4     1     1
== UTILIZATION:
0 0 0
0 0 0
1 0 0
1 0 0
0 0 0
0 0 0
1 0 0
0 1 0
0 1 1
1 0 0
0 0 0
0 0 0
0 0 0
"""


def test_a_first_chunk_branch_counts_at_the_share_of_steps_that_run_it():
    bundles = _schedule.parse_bundles(WHEN_BUNDLES)
    assert _schedule.find_conditionals(bundles) == [
        _schedule.Conditional(first=7, last=9, axis=1, value=0, when_equal=True)
    ]
    # Grid (8 tiles, 4 chunks): 0x7-0x9 run at a quarter of the steps, the other 7 bundles at each.
    step = _schedule.step_schedule(WHEN_BUNDLES, WHEN_UTILIZATION, grid=(8, 4))
    assert step.bundles == pytest.approx(7 + 3 / 4)
    assert step.spill_stores == pytest.approx(1 / 4)
    assert step.units["VSTORE"] == pytest.approx(2 / 4)
    assert step.units["VALU"] == pytest.approx(3 + 1 / 4)
    assert _schedule.estimate_us(step, 32, "v5e") == pytest.approx(7.75 * 32 / _schedule.CHIPS["v5e"]["clock_hz"] * 1e6)
    # Without the grid, or on a grid of one chunk, the region runs at every step.
    assert _schedule.step_schedule(WHEN_BUNDLES, WHEN_UTILIZATION).bundles == 10
    assert _schedule.step_schedule(WHEN_BUNDLES, WHEN_UTILIZATION, grid=(8, 1)).bundles == 10


def test_a_branch_on_a_grid_index_counts_by_its_predicate():
    # Skipped where the index is 0 (a branch on the compare's negation): three quarters of the steps.
    negated = WHEN_BUNDLES.replace("sbr.rel (%p198723_p5)", "sbr.rel (!%p198723_p5)")
    assert _schedule.step_schedule(negated, WHEN_UTILIZATION, grid=(8, 4)).bundles == pytest.approx(7 + 3 * 3 / 4)
    # "eq" skips at the index: the region runs at the other three chunks.
    equal = WHEN_BUNDLES.replace("scmp.ne.s32.totalorder %s467557_s7, 0", "scmp.eq.s32.totalorder %s467557_s7, 3")
    assert _schedule.step_schedule(equal, WHEN_UTILIZATION, grid=(8, 4)).bundles == pytest.approx(7 + 3 * 3 / 4)
    # A predicate that is no compare of a grid index (the pipeline's DMA conditions): every step.
    other = WHEN_BUNDLES.replace("scmp.ne.s32.totalorder %s467557_s7, 0", "pnand %p1_p1, %p2_p2")
    assert _schedule.step_schedule(other, WHEN_UTILIZATION, grid=(8, 4)).bundles == 10
    # A register that is not a grid index (no "iter bound" on its phi): every step.
    plain = WHEN_BUNDLES.replace("stage = 1 iter bound = 1 :: iteration index, stage = 1 iter bound = 1", "")
    assert _schedule.step_schedule(plain, WHEN_UTILIZATION, grid=(8, 4)).bundles == 10
