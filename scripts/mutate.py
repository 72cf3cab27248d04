#!/usr/bin/env python3
"""Mutation check of the test suite (`make mutate`): plants each semantic bug below in a copy of the
tree, rebuilds incrementally, runs the fast tests, and fails unless every mutation is caught.

A mutation that survives is a test to write, never an entry to delete. When the code a mutation
edits changes, update its `old` text: the script refuses a mutation whose text it cannot find.

    python3 scripts/mutate.py                 # all mutations
    python3 scripts/mutate.py --list          # names and descriptions
    python3 scripts/mutate.py --only NAME...  # some of them
    python3 scripts/mutate.py --keep-going    # run every mutation even after a survivor
    python3 scripts/mutate.py --all-failures  # count every failing C++ test, not just the first

The copy lives in build-mutate/tree (kept between runs, so rebuilds are incremental); only tracked
and untracked-but-not-ignored files are copied. Stdlib only; the Python stage uses .venv's python.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build-mutate"
TREE = WORK / "tree"
# Inside the copy, as build/ is inside the checkout: with the Makefile's CCACHE_BASEDIR (the
# checkout) ccache sees the same relative paths and flags as build/ and the pip build, so the
# baseline build is served from their compiles.
BUILD = TREE / "build"
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"

# The C++ stage: every kernel, split, reference and edge test but the slow timing-style ones (thread
# counts, roofline, determinism sweeps, the D = 1024 shapes); stops at the first failure.
CPP_FILTER = "-CoefficientTokenLoop.*:Threads.*:Roofline.*:MixAndDtype/*:*D1024*"
# The Python stage: the tests that reach the kernels through the FFI with non-default configs.
PYTHON_TESTS = [
    "tests/python/test_kernels_vs_reference.py::test_non_default_config",
    "tests/python/test_properties.py::test_kernel_path_matches_float64_reference",
]


@dataclasses.dataclass(frozen=True)
class Edit:
    path: str
    old: str
    new: str
    count: int = 1  # occurrences of `old` the file must hold; all of them are replaced


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    description: str
    edits: tuple[Edit, ...]
    python: bool = False  # also run the Python stage (bugs the C++ tests cannot see)
    python_tests: tuple[str, ...] = tuple(PYTHON_TESTS)  # that stage's tests for this mutation


COEFFICIENTS = "src/cpu/coefficients.cc"
POST = "src/cpu/post.cc"
SIMD = "src/cpu/simd.h"
VECTOR_MATH = "src/cpu/vector_math.cc"
REFERENCE = "src/core/reference.cc"
TPU_PRE = "python/mhc/tpu/_pre.py"
TPU_POST = "python/mhc/tpu/_post.py"
TPU_TESTS = "tests/python/test_tpu_kernels.py"
TPU_PRE_BACKWARD = "python/mhc/tpu/_pre_backward.py"
TPU_HEAD = "python/mhc/tpu/_head.py"
TPU_BOUNDARY = "python/mhc/tpu/_boundary.py"
TPU_COLLAPSE = "python/mhc/tpu/_collapse.py"
TPU_LAYOUT = "python/mhc/tpu/_layout.py"

MUTATIONS = (
    Mutation(
        "post_scale_ignored",
        "the kernels use post_scale = 2 whatever the config says",
        (
            Edit(COEFFICIENTS, "config_.post_scale * sigmoid", "2.0 * sigmoid"),
            Edit(COEFFICIENTS, "double{config_.post_scale}", "2.0"),
        ),
    ),
    Mutation(
        "ffi_drops_config_scalars",
        "the FFI layer drops sinkhorn_eps, rms_eps, pre_eps and post_scale (the kernels see defaults)",
        (
            Edit(
                "src/ffi/handler_common.h",
                "  config.sinkhorn_eps = sinkhorn_eps;\n  config.rms_eps = rms_eps;\n"
                "  config.pre_eps = pre_eps;\n  config.post_scale = post_scale;\n",
                "  (void)sinkhorn_eps, (void)rms_eps, (void)pre_eps, (void)post_scale;\n",
            ),
        ),
        python=True,
    ),
    Mutation(
        "run_reads_the_config_from_the_first_input",
        "mhc._mhc_cpu.run takes D from the operation's first input instead of x (wrong wherever x is not first)",
        (
            Edit(
                "src/ffi/cpu_handlers.cc",
                "input_views[mhc_ffi::x_index(op)]",
                "input_views[0]",
            ),
        ),
        python=True,
        python_tests=("tests/python/test_operation_table.py",),
    ),
    Mutation(
        "declared_layer_in_f32",
        "the operation table declares the pre forward's layer_in f32 whatever x's dtype (JAX allocates f32 for bf16 x)",
        (
            Edit(
                "src/ffi/operations.h",
                '{prefix "layer_in", "[T, D]", "dtype of x"}',
                '{prefix "layer_in", "[T, D]", "f32"}',
            ),
        ),
        python=True,
        python_tests=("tests/python/test_kernels_vs_reference.py::test_outputs_and_gradients",),
    ),
    Mutation(
        "sinkhorn_one_iteration_short",
        "one Sinkhorn iteration fewer than configured (forward and backward), when there are two or more",
        (
            # The iteration count both Sinkhorn paths (the n = 4 kernel, the generic loops) read.
            Edit(
                COEFFICIENTS,
                "return {n, config.sinkhorn_iters, config.sinkhorn_eps,",
                "return {n, config.sinkhorn_iters - (config.sinkhorn_iters > 1 ? 1 : 0), config.sinkhorn_eps,",
            ),
        ),
    ),
    Mutation(
        "h_pre_without_pre_eps",
        "H_pre = sigmoid(a) without + pre_eps",
        (Edit(COEFFICIENTS, "sigmoids_[k] + config_.pre_eps", "sigmoids_[k]"),),
    ),
    Mutation(
        "bf16_loads_drop_lowest_bit",
        "every bf16 load clears the lowest mantissa bit (inputs off by up to 2^-7)",
        (
            Edit(
                SIMD,
                "const Bits8x16 bits = *reinterpret_cast<const UnalignedBits8x16*>(p);",
                "const Bits8x16 bits = *reinterpret_cast<const UnalignedBits8x16*>(p) & (uint16_t)0xfffe;",
            ),
            Edit(
                VECTOR_MATH,
                "static_cast<uint32_t>(src[k].bits) << 16",
                "static_cast<uint32_t>(src[k].bits & 0xfffeu) << 16",
            ),
            Edit(
                POST,
                "inline float scalar(bf16 v) { return to_float(v); }",
                "inline float scalar(bf16 v) { return to_float(bf16{static_cast<uint16_t>(v.bits & 0xfffeu)}); }",
            ),
        ),
    ),
    Mutation(
        "bf16_stores_truncate",
        "bf16 stores truncate instead of rounding to nearest even",
        (
            Edit(
                SIMD,
                "const Bits8x32 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;",
                "const Bits8x32 rounded = bits >> 16;",
            ),
            Edit(
                VECTOR_MATH,
                "for (; k < count; ++k) dst[k] = to_bf16(src[k]);",
                "for (; k < count; ++k) {\n    uint32_t word;\n    std::memcpy(&word, src + k, 4);\n"
                "    dst[k] = bf16{static_cast<uint16_t>(word >> 16)};\n  }",
            ),
            Edit(
                POST,
                "inline void put(bf16* p, float v) { *p = to_bf16(v); }",
                "inline void put(bf16* p, float v) {\n  uint32_t word;\n"
                "  std::memcpy(&word, &v, 4);\n  p->bits = static_cast<uint16_t>(word >> 16);\n}",
            ),
        ),
    ),
    Mutation(
        "h_res_transposed_in_kernels_and_reference",
        "out[j] sums row j of H_res instead of column j, in the kernels and in the float64 reference alike",
        (
            Edit(POST, "acc += hr[i * n + j] * rows[i];", "acc += hr[j * n + i] * rows[i];"),
            Edit(
                POST,
                "acc += hr[i * n + j] * scalar(x[i * D + d]);",
                "acc += hr[j * n + i] * scalar(x[i * D + d]);",
            ),
            Edit(POST, "dx += hr[i * n + j] * gs[j];", "dx += hr[j * n + i] * gs[j];"),
            Edit(
                POST,
                "dx += hr[i * n + j] * scalar(g[j * D + d]);",
                "dx += hr[j * n + i] * scalar(g[j * D + d]);",
            ),
            Edit(POST, "res[i * n + j] += xw * gw[j];", "res[j * n + i] += xw * gw[j];"),
            Edit(
                POST,
                "res_tail[i * n + j] += xi * scalar(g[j * D + d]);",
                "res_tail[j * n + i] += xi * scalar(g[j * D + d]);",
            ),
            Edit(
                REFERENCE,
                "value += h_res[(t * n + i) * n + j] * x[(t * n + i) * D + d];",
                "value += h_res[(t * n + j) * n + i] * x[(t * n + i) * D + d];",
            ),
            Edit(
                REFERENCE,
                "out.dh_res[(t * n + i) * n + j] += x[(t * n + i) * D + d] * gj;",
                "out.dh_res[(t * n + j) * n + i] += x[(t * n + i) * D + d] * gj;",
            ),
            Edit(
                REFERENCE,
                "out.dx_partial[(t * n + i) * D + d] += h_res[(t * n + i) * n + j] * gj;",
                "out.dx_partial[(t * n + i) * D + d] += h_res[(t * n + j) * n + i] * gj;",
            ),
        ),
        python=True,
    ),
    Mutation(
        "h_res_transposed_in_post_forward",
        "post_forward alone sums row j of H_res (the backward and the reference keep column j)",
        (
            Edit(POST, "acc += hr[i * n + j] * rows[i];", "acc += hr[j * n + i] * rows[i];"),
            Edit(
                POST,
                "acc += hr[i * n + j] * scalar(x[i * D + d]);",
                "acc += hr[j * n + i] * scalar(x[i * D + d]);",
            ),
        ),
    ),
    Mutation(
        "sinkhorn_ends_on_rows",
        "the Sinkhorn forward starts and ends on rows instead of columns (the n = 4 kernel and the generic loops)",
        (
            Edit(
                COEFFICIENTS,
                "  column_step();\n  for (int64_t iter = 1; iter < b.iters; ++iter) {\n    row_step();\n"
                "    column_step();\n",
                "  row_step();\n  for (int64_t iter = 1; iter < b.iters; ++iter) {\n    column_step();\n"
                "    row_step();\n",
            ),
            Edit(
                COEFFICIENTS,
                "  normalize_columns(n, b.eps, y, q);\n  keep();\n  for (int64_t iter = 1; iter < b.iters; ++iter) {\n"
                "    normalize_rows(n, b.eps, y, q);\n    keep();\n    normalize_columns(n, b.eps, y, q);\n",
                "  normalize_rows(n, b.eps, y, q);\n  keep();\n  for (int64_t iter = 1; iter < b.iters; ++iter) {\n"
                "    normalize_columns(n, b.eps, y, q);\n    keep();\n    normalize_rows(n, b.eps, y, q);\n",
            ),
        ),
    ),
    Mutation(
        "rms_term_with_r_not_r_cubed",
        "the RMS term of dx uses r instead of r^3",
        (
            Edit(
                "src/cpu/pre_backward.cc",
                "dr * r * r * r / static_cast<double>(dims.M_full)",
                "dr * r / static_cast<double>(dims.M_full)",
            ),
        ),
    ),
    Mutation(
        "dalpha_without_r",
        "dalpha sums da * P instead of da * Z = da * r P",
        (Edit(COEFFICIENTS, "dalpha_group += da[c] * (r * P[c]);", "dalpha_group += da[c] * P[c];"),),
    ),
    Mutation(
        "sinkhorn_backward_sign",
        "the Sinkhorn column step's backward adds the dot instead of subtracting it (both paths)",
        (
            Edit(
                COEFFICIENTS,
                "g[i * n + j] = (g[i * n + j] - dots[j]) * q[j];",
                "g[i * n + j] = (g[i * n + j] + dots[j]) * q[j];",
            ),
            Edit(
                COEFFICIENTS,
                "g[2 * i] = (g[2 * i] - dots_left) * q_left;",
                "g[2 * i] = (g[2 * i] + dots_left) * q_left;",
            ),
        ),
    ),
    Mutation(
        "permutation_table_off_by_one",
        "the kernels' permutation table starts at the second permutation (p -> p + 1 mod n!)",
        (
            Edit(
                COEFFICIENTS,
                "const std::vector<int> perm = permutation(n_, p);",
                "const std::vector<int> perm = permutation(n_, (p + 1) % R_);",
            ),
        ),
    ),
    Mutation(
        "permutation_order_shared",
        "permutation(n, p), shared by the kernels and the reference, returns the (p+1)-th permutation",
        (
            Edit(
                "src/core/config.cc",
                "  std::vector<int> unused(static_cast<size_t>(n));",
                "  p = (p + 1) % count;\n  std::vector<int> unused(static_cast<size_t>(n));",
            ),
        ),
    ),
    Mutation(
        "head_fn_untransposed",
        "the head reads V4's fn [n, M] as if it were already phi [M, n]",
        (
            Edit(
                "src/cpu/head.cc",
                "layout->phi[m * n + k] = fn[k * M + m]",
                "layout->phi[m * n + k] = fn[m * n + k]",
            ),
        ),
    ),
    Mutation(
        "head_drops_pre_eps",
        "the head's gates are sigmoid(a) without + pre_eps (forward and backward)",
        (
            Edit(
                "src/cpu/head.cc",
                "    pre_forward_tiles<X>(config, dims, layout.weights,",
                "    Config without_eps = config;\n    without_eps.pre_eps = 0.0f;\n"
                "    pre_forward_tiles<X>(without_eps, dims, layout.weights,",
            ),
            Edit(
                "src/cpu/head.cc",
                "    pre_backward_tiles<X>(config, dims, layout.weights,",
                "    Config without_eps = config;\n    without_eps.pre_eps = 0.0f;\n"
                "    pre_backward_tiles<X>(without_eps, dims, layout.weights,",
            ),
        ),
    ),
    Mutation(
        "boundary_backward_keeps_padded_rows",
        "the fused boundary's backward lets the token rows XLA padded into the parameter gradients",
        (
            Edit(
                "python/mhc/jax/_kernels/boundary.py",
                "_zero_padded_rows(plan.valid_tokens(lead), *next_cotangents, x,",
                "_zero_padded_rows(None, *next_cotangents, x,",
            ),
        ),
        python=True,
        python_tests=("tests/python/test_sharding.py::test_padded_rows_stay_out_of_parameter_gradients",),
    ),
    Mutation(
        "split_pre_partials_not_summed",
        "the tensor-parallel pre forward drops the psum of its partial sums over the D slices: each device's "
        "coefficients from its own slice only",
        (
            Edit(
                "python/mhc/jax/_kernels/pre.py",
                "        partials = jax.lax.psum(partials, plan.feature_axes)\n",
                "        partials = partials\n",
            ),
        ),
        python=True,
        python_tests=("tests/python/test_sharding.py::test_carried_mix_inside_shard_map_with_d_split",),
    ),
    Mutation(
        "carried_gradient_summed_twice_in_shard_map",
        "inside shard_map with D split, dcarried is summed over the devices in the backward and again by the "
        "transpose of the carried input: P times too large",
        (
            Edit(
                "python/mhc/jax/_kernels/dispatch.py",
                "features=tensor_axis if slices > 1 else None, slices=slices, shares=True)",
                "features=tensor_axis if slices > 1 else None, slices=slices, shares=False)",
            ),
        ),
        python=True,
        python_tests=("tests/python/test_sharding.py::test_carried_mix_inside_shard_map_with_d_split",),
    ),
    Mutation(
        "vmap_folds_batch_into_wrong_axis",
        "vmap's batching rule folds the batch into the token axes but tells the partitioning rule one fewer",
        (
            Edit(
                "python/mhc/jax/_partitioning.py",
                "results = apply(operation, config, lead + 1, *folded)",
                "results = apply(operation, config, lead, *folded)",
            ),
        ),
        python=True,
        python_tests=("tests/python/test_sharding.py::test_vmap_of_sharded_arrays[shardy]",),
    ),
    Mutation(
        "recompute_policy_saves_x",
        "recompute_policy keeps the streams x (the residuals named mhc_x) instead of letting the backward rebuild them",
        (Edit("python/mhc/jax/__init__.py", 'return params.get("name") != _kernels.RESIDUAL_X', "return True"),),
        python=True,
        # Values and gradients stay right; only what is saved (and the memory) changes.
        python_tests=(
            "tests/python/test_recompute.py::test_the_policy_keeps_no_stream_but_the_groups_input[boundary]",
        ),
    ),
    Mutation(
        "torch_pre_drops_dx_partial",
        "mhc.torch's pre backward ignores the streams' gradient from the post (the cotangent of Context.x)",
        (
            Edit(
                "python/mhc/torch/_ops.py",
                "cotangents = [c.contiguous() for c in (dlayer_in, dx_partial, dh_post, dh_res)]",
                "cotangents = [c.contiguous() for c in (dlayer_in, torch.zeros_like(dx_partial), dh_post, dh_res)]",
            ),
        ),
        python=True,
        python_tests=("tests/python/test_torch.py::test_sublayer_matches_float64[sinkhorn-kernel-float32]",),
    ),
    Mutation(
        "torch_hf_comb_transposed",
        "mhc.torch.hf's HyperConnection returns comb transposed (H_res read as [output, input])",
        (
            Edit(
                "python/mhc/torch/hf.py",
                "return ctx.h_post, ctx.h_res, collapsed",
                "return ctx.h_post, ctx.h_res.mT, collapsed",
            ),
        ),
        python=True,
        python_tests=(
            "tests/python/test_torch_hf.py::test_patch_keeps_the_state_dict_and_matches_the_float64_model[modules]",
        ),
    ),
    Mutation(
        "boundary_recompute_first_tile_gates",
        "the fused boundary backward recomputes every tile's x_next with the first tile's h_post, h_res",
        (
            Edit(
                "src/cpu/boundary.cc",
                "post_forward_tokens(x + t0 * M, layer_out + t0 * D, h_post + t0 * n, h_res + t0 * n * n, n, D,",
                "post_forward_tokens(x + t0 * M, layer_out + t0 * D, h_post, h_res, n, D,",
            ),
        ),
    ),
    Mutation(
        "carried_backward_applies_own_gates",
        "pre_backward_carried's dx takes the pre-apply term with the sublayer's own h_pre, not the carried mix",
        (
            Edit(
                "src/cpu/pre_backward.cc",
                "      std::copy_n(supplied.mix.row(token, n, pre), supplied.mix.streams(n), pre);\n",
                "",
            ),
        ),
    ),
    Mutation(
        "collapse_first_token_mix",
        "the V4.1 collapse mixes every token with the first token's carried weights",
        (
            Edit(
                "src/cpu/collapse.cc",
                "mix.row(t, n, nullptr), D, out + t * D);",
                "mix.row(0, n, nullptr), D, out + t * D);",
            ),
        ),
    ),
    Mutation(
        "carried_mix_unnamed",
        "V4.1's pre saves the carried mix without its checkpoint name (a names policy re-runs the sublayer before)",
        (
            Edit(
                "python/mhc/jax/_kernels/pre.py",
                "saved = (*_named(RESIDUAL_X, x), *_named(RESIDUAL_COEFFICIENTS, carried), *_named(RESIDUAL_PARTIALS,",
                "saved = (*_named(RESIDUAL_X, x), carried, *_named(RESIDUAL_PARTIALS,",
            ),
        ),
        python=True,
        # a real carried mix at a seam; the first sublayer's one-hot is an empty array
        python_tests=("tests/python/test_checkpoint_names.py::test_a_real_carried_mix_at_a_seam_is_saved_by_its_name",),
    ),
    Mutation(
        "v41_config_eps_ignored",
        "config_from_v4 fixes V4.1's mHC RMS eps at 1e-20 whatever the config's rms_norm_eps / norm_eps say",
        (
            Edit(
                "python/mhc/interop.py",
                'rms_eps = fields.get("norm_eps", fields.get("rms_norm_eps", V41_RMS_EPS if v41 else 1e-6))',
                'rms_eps = V41_RMS_EPS if v41 else fields.get("norm_eps", fields.get("rms_norm_eps", 1e-6))',
            ),
        ),
        python=True,
        python_tests=("tests/python/test_interop.py::test_config_from_v41",),
    ),
    Mutation(
        "unknown_model_type_read_as_v4",
        "config_from_v4 reads a configuration of another model_type as DeepSeek-V4 instead of raising",
        (Edit("python/mhc/interop.py", "elif model_type is not None and model_type not in MODEL_TYPES:", "elif 0:"),),
        python=True,
        python_tests=("tests/python/test_interop.py::test_config_from_v4_rejects_what_it_cannot_place",),
    ),
    Mutation(
        "interpret_switch_outside_cache_keys",
        "interpret_on_cpu's switch left out of JAX's cache keys: a function compiled outside runs CPU kernels inside",
        (
            Edit(
                "python/mhc/tpu/testing.py",
                "    _interpret_params_key.set_global(interpret)\n",
                "    pass\n",
            ),
        ),
        python=True,
        python_tests=(
            "tests/python/test_tpu_dispatch.py::test_a_function_compiled_outside_runs_the_tpu_kernels_inside",
        ),
    ),
    Mutation(
        "tpu_kernel_missing_from_table",
        "mhc.tpu.KERNELS loses the V4.1 collapse backward: a TPU would raise where it ran before",
        (Edit("python/mhc/tpu/__init__.py", '    "mhc_collapse_backward": collapse_backward,\n', ""),),
        python=True,
        python_tests=("tests/python/test_dispatch.py::test_each_backend_has_exactly_its_kernels[tpu]",),
    ),
    Mutation(
        "tpu_projection_default_precision",
        "the TPU pre kernel's f32 projection dot drops precision=HIGHEST (default MXU precision, not fp32 contraction)",
        (
            Edit(
                TPU_PRE,
                "return jnp.dot(a, hi + (mid + lo), precision=_HIGHEST, preferred_element_type=_F32)",
                "return jnp.dot(a, hi + (mid + lo), preferred_element_type=_F32)",
            ),
        ),
        python=True,
        # The interpreter computes in f32 whatever precision was asked: only the lowered Mosaic shows it.
        python_tests=(f"{TPU_TESTS}::test_projection_dots_carry_full_f32_precision[3-sinkhorn-float32]",),
    ),
    Mutation(
        "tpu_projection_weight_two_terms",
        "the TPU pre kernel's bf16 projection drops the weight's third bf16 term (16 of its 24 bits)",
        (Edit(TPU_PRE, "for t in (hi, mid, lo)]", "for t in (hi, mid, jnp.zeros_like(lo))]"),),
        python=True,
        # About 2^-17 of each product: under the f32 bound on most draws; the terms' sum shows it.
        python_tests=(f"{TPU_TESTS}::test_stacked_projection_carries_the_weights_24_bits",),
    ),
    Mutation(
        "tpu_pre_apply_bf16_running_sum",
        "the TPU pre_apply (pre, boundary, head, collapse) keeps its running sum in bf16, not f32",
        (
            Edit(
                TPU_PRE,
                "    layer_in = gates[0] * streams[0]\n"
                "    for k in range(1, len(streams)):\n"
                "        layer_in += gates[k] * streams[k]\n",
                "    layer_in = (gates[0] * streams[0]).astype(jnp.bfloat16)\n"
                "    for k in range(1, len(streams)):\n"
                "        layer_in = (layer_in + gates[k] * streams[k]).astype(jnp.bfloat16)\n",
            ),
        ),
        python=True,
        # The norm at 1e-2 passes; the element-wise bound of the precision policy fails.
        python_tests=(f"{TPU_TESTS}::test_pre_forward_matches_reference[3-1-37-permutations-bfloat16-custom]",),
    ),
    Mutation(
        "tpu_split_finish_local_rms_mean",
        "the TPU split forward's finish takes the RMS mean over its own D slice instead of the whole D",
        (
            Edit(
                "python/mhc/tpu/_split.py",
                "functools.partial(_forward_finish_kernel, config=config, features=d * slices, mode=mode)",
                "functools.partial(_forward_finish_kernel, config=config, features=d, mode=mode)",
            ),
        ),
        python=True,
        python_tests=(
            "tests/python/test_tpu_split.py::test_split_forms_match_reference[4-130-37-sinkhorn-float32-default-None]",
        ),
    ),
    Mutation(
        "tpu_dh_res_shifted",
        "the TPU post backward's dh_res[i, j] pairs x_i with g_(j+1 mod n) instead of g_j",
        (
            Edit(
                TPU_POST,
                "dh_res += [jnp.sum(x_i * g[j], axis=1, keepdims=True) for j in range(n)]",
                "dh_res += [jnp.sum(x_i * g[(j + 1) % n], axis=1, keepdims=True) for j in range(n)]",
            ),
        ),
        python=True,
        python_tests=(f"{TPU_TESTS}::test_post_forward_and_backward_match_reference[3-1-37-bfloat16]",),
    ),
    Mutation(
        "tpu_post_pairs_ties_away",
        "the TPU post forward's bf16 n = 4 kernel rounds ties away from zero instead of to even",
        (
            Edit(
                TPU_POST,
                # the forward's line (the backward's rounding has the same text)
                "a NaN stays a (quiet) NaN\n"
                "                rounded = bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))",
                "a NaN stays a (quiet) NaN\n                rounded = bits + jnp.uint32(0x8000)",
            ),
        ),
        python=True,
        # Random data hits a tie too rarely; the exact-tie test sees it.
        python_tests=(f"{TPU_TESTS}::test_post_forward_rounds_ties_to_even[4]",),
    ),
    Mutation(
        "tpu_post_pairs_stream_from_wrong_sublane",
        "the TPU post forward's bf16 n = 4 kernel takes stream 2 for its even sublanes from the token before",
        (
            Edit(
                TPU_POST,
                "jnp.where(even, pltpu.roll(low_streams, height - 1, 0), low_streams)",
                "jnp.where(even, pltpu.roll(low_streams, 1, 0), low_streams)",
            ),
        ),
        python=True,
        python_tests=(f"{TPU_TESTS}::test_post_forward_and_backward_match_reference[4-130-300-bfloat16]",),
    ),
    Mutation(
        "tpu_post_backward_pairs_streams_swapped",
        "the TPU post backward's bf16 n = 4 kernel writes dx's streams 2 and 3 where 0 and 1 belong",
        (
            Edit(
                TPU_POST,
                "out_ref[pl.ds(0, rows, stride=2), :] = halves[1] | (halves[0] >> 16)",
                "out_ref[pl.ds(0, rows, stride=2), :] = halves[3] | (halves[2] >> 16)",
            ),
        ),
        python=True,
        python_tests=(f"{TPU_TESTS}::test_post_backward_pairs_kernel_gives_the_general_kernels_dx_and_dlayer_out",),
    ),
    Mutation(
        "tpu_chunk_sum_overwritten",
        "the TPU post backward's dh_post keeps only the last feature chunk's sum (= instead of +=)",
        (Edit(TPU_POST, "dh_post_ref[...] += dh_post", "dh_post_ref[...] = dh_post"),),
        python=True,
        # D = 600 pads to five 128-lane chunks; a single-chunk case cannot see this.
        python_tests=(f"{TPU_TESTS}::test_post_forward_and_backward_match_reference[1-600-37-float32]",),
    ),
    Mutation(
        "tpu_sinkhorn_backward_drops_dot",
        "the TPU pre backward's Sinkhorn column step drops its dot term: dX = dY / (s + eps)",
        (
            Edit(
                TPU_PRE_BACKWARD,
                "return [(d - dots) / divisor for d in grads]",
                "return [d / divisor for d in grads]",
            ),
        ),
        python=True,
        python_tests=(
            "tests/python/test_tpu_pre_backward.py::test_pre_backward_matches_reference[4-130-300-sinkhorn-float32-default]",
        ),
    ),
    Mutation(
        "tpu_sinkhorn_backward_without_eps",
        "the TPU pre backward's Sinkhorn column step divides by the column sum without sinkhorn_eps",
        (
            Edit(
                TPU_PRE_BACKWARD,
                "divisor = jnp.where(valid, functools.reduce(jnp.add, inputs) + eps, 1.0)",
                "divisor = jnp.where(valid, functools.reduce(jnp.add, inputs), 1.0)",
            ),
        ),
        python=True,
        # sinkhorn_eps = 0.05: at the default 1e-6 the error is about the bound itself.
        python_tests=(
            "tests/python/test_tpu_pre_backward.py::test_pre_backward_matches_reference[8-1-37-sinkhorn-float32-custom]",
        ),
    ),
    Mutation(
        "tpu_backward_dx_six_terms_mismatched",
        "the TPU pre backward's six-term dP W pairs dP's mid term with the weight's hi term twice (mid W_mid dropped)",
        (
            Edit(
                TPU_PRE_BACKWARD,
                "return jnp.concatenate([hi, mid, lo, hi, mid, hi], axis=0)",
                "return jnp.concatenate([hi, mid, lo, hi, hi, hi], axis=0)",
            ),
        ),
        python=True,
        python_tests=(
            "tests/python/test_tpu_pre_backward.py::test_pre_backward_matches_reference[4-130-300-sinkhorn-float32-default]",
        ),
    ),
    Mutation(
        "tpu_backward_stream_major_streams_swapped",
        "the TPU pre backward's stream-major copy of bf16 x (n = 4) stores each stream in the next one's place",
        (
            Edit(
                TPU_PRE_BACKWARD,
                "streams_ref[k, tokens, lanes] = stream.astype(streams_ref.dtype)",
                "streams_ref[(k + 1) % n, tokens, lanes] = stream.astype(streams_ref.dtype)",
            ),
        ),
        python=True,
        python_tests=(
            "tests/python/test_tpu_pre_backward.py::test_pre_backward_matches_reference[4-1024-37-sinkhorn-bfloat16-default]",
        ),
    ),
    Mutation(
        "tpu_backward_core_partials_dropped",
        "the TPU backwards split over two cores keep only the first core's parameter-gradient partial sums",
        (
            Edit(
                TPU_LAYOUT,
                "return functools.reduce(jnp.add, [partials[core] for core in range(partials.shape[0])])",
                "return partials[0]",
            ),
        ),
        python=True,
        python_tests=("tests/python/test_tpu_pre_backward.py::test_pre_backward_split_over_two_cores",),
    ),
    Mutation(
        "tpu_backward_empty_core",
        "the backwards' core split uses every core asked for, so a core can hold no token tile",
        (
            Edit(
                TPU_LAYOUT,
                "return cls(tiles, chunks, pl.cdiv(tiles, per_core), per_core)",
                "return cls(tiles, chunks, max(1, min(cores or tensor_cores(), tiles)), per_core)",
            ),
        ),
        python=True,
        python_tests=(
            "tests/python/test_tpu_pre_backward.py::test_core_split_covers_every_tile_once_with_no_empty_core",
        ),
    ),
    Mutation(
        "tpu_backward_trailing_steps_run",
        "the last core's trailing grid steps (past the last token tile) run the backward body",
        (Edit(TPU_LAYOUT, "if self.cores * self.tiles_per_core == self.tiles:", "if True:"),),
        python=True,
        python_tests=("tests/python/test_tpu_pre_backward.py::test_pre_backward_split_over_two_cores",),
    ),
    Mutation(
        "tpu_backward_trailing_steps_move_chunks",
        "the trailing grid steps' blocks follow the feature chunks instead of staying on the last one",
        (Edit(TPU_LAYOUT, "jnp.where(holds_tile, chunk, self.chunks - 1)", "chunk"),),
        python=True,
        python_tests=("tests/python/test_tpu_pre_backward.py::test_pre_backward_split_over_two_cores",),
    ),
    Mutation(
        "tpu_head_gates_without_pre_eps",
        "the TPU head forward's gates drop pre_eps",
        (
            Edit(
                TPU_HEAD,
                "gates = _pre.sigmoid(scale_ref[...] * (r * logits) + bias_ref[...]) + config.pre_eps",
                "gates = _pre.sigmoid(scale_ref[...] * (r * logits) + bias_ref[...])",
            ),
        ),
        python=True,
        # pre_eps = 0.1 (CUSTOM): the default 1e-6 is within the bound.
        python_tests=(
            "tests/python/test_tpu_head.py::test_head_forward_and_backward_match_reference[8-1-37-float32-custom]",
        ),
    ),
    Mutation(
        "tpu_head_dscale_first_gate_only",
        "the TPU head backward's dscale keeps only the first gate's share",
        (
            Edit(
                TPU_HEAD,
                "return dx, dfn, dbias[:n], jnp.sum(dalpha[:n]).reshape(1)",
                "return dx, dfn, dbias[:n], dalpha[:1]",
            ),
        ),
        python=True,
        python_tests=(
            "tests/python/test_tpu_head.py::test_head_forward_and_backward_match_reference[4-130-300-float32-default]",
        ),
    ),
    Mutation(
        "tpu_boundary_chunk_offset",
        "the TPU boundary backward's post half pairs every feature chunk of g with x's first chunk",
        (Edit(TPU_BOUNDARY, "x_ref.at[:, :, lanes],", "x_ref.at[:, :, pl.ds(0, chunk)],"),),
        python=True,
        # D = 600 pads to five 128-lane chunks; a single-chunk case cannot see this.
        python_tests=(
            "tests/python/test_tpu_boundary.py::test_boundary_backward_matches_reference"
            "[3-600-20-permutations-float32-float32-custom-128]",
        ),
    ),
    Mutation(
        "tpu_carried_dx_own_gates",
        "the TPU pre_backward_carried's dx takes the sublayer's own gates for the pre-apply instead of the carried mix",
        (Edit(TPU_PRE_BACKWARD, "pre_apply_weights = carried_ref[...]", "pre_apply_weights = s_pre + config.pre_eps"),),
        python=True,
        python_tests=(
            "tests/python/test_tpu_carried.py::test_pre_carried_matches_reference[4-130-37-sinkhorn-float32-True-custom]",
        ),
    ),
    Mutation(
        "tpu_one_hot_collapse_dx_unwritten",
        "the TPU one-hot collapse backward writes dx of stream 0 only, leaving streams 1..n-1 unwritten",
        (
            Edit(
                TPU_COLLAPSE,
                "        for k in range(1, n):\n            dx_ref[:, k, :] = jnp.zeros(dout.shape, dx_ref.dtype)\n",
                "",
            ),
        ),
        python=True,
        # n = 1 has no other stream: the one-hot at n = 3.
        python_tests=("tests/python/test_tpu_carried.py::test_collapse_matches_reference[3-1-37-float32-False]",),
    ),
    Mutation(
        "tpu_schedule_inner_loop_once",
        "the TPU static estimate counts an inner loop of the grid step once instead of once per trip",
        (Edit("python/mhc/tpu/_schedule.py", "count += trips * child_count", "count += child_count"),),
        python=True,
        python_tests=("tests/python/test_tpu_schedule.py::test_step_schedule_expands_the_inner_loop_by_its_trips",),
    ),
    Mutation(
        "tpu_schedule_branch_every_step",
        "the TPU static estimate counts a first-chunk pl.when at every grid step instead of its share of them",
        (Edit("python/mhc/tpu/_schedule.py", "weight[address] *= share", "weight[address] *= 1.0"),),
        python=True,
        python_tests=(
            "tests/python/test_tpu_schedule.py::test_a_first_chunk_branch_counts_at_the_share_of_steps_that_run_it",
        ),
    ),
    Mutation(
        "tpu_post_fixed_vmem_limit",
        "the TPU post forward asks for a fixed 64 MiB VMEM limit instead of the chip's (two VMEM policies)",
        (
            Edit(
                TPU_POST,
                'compiler_params=_layout.compiler_params("parallel", "parallel"),',
                'compiler_params=_layout.compiler_params("parallel", "parallel", capacity=2**26 * 8 // 7),',
            ),
        ),
        python=True,
        python_tests=(
            "tests/python/test_tpu_names.py::"
            "test_each_kernel_is_named_after_its_operation_and_tile_with_the_chips_vmem_limit[mhc_post_forward]",
        ),
    ),
)


def run(command, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, text=True, capture_output=True, **kwargs)


def tree_files() -> list[str]:
    """Tracked and untracked-but-not-ignored files, as the device tool and CI see the tree."""
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True)
    return [path for path in listed.stdout.split("\0") if path and (ROOT / path).is_file()]


def sync_tree() -> None:
    """Copies changed files only (unchanged ones keep their timestamps, so rebuilds stay incremental)."""
    wanted = set(tree_files())
    for path in sorted(wanted):
        source, target = ROOT / path, TREE / path
        data = source.read_bytes()
        if not target.exists() or target.read_bytes() != data:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            shutil.copymode(source, target)
    for target in TREE.rglob("*"):
        relative = target.relative_to(TREE).as_posix()
        kept = relative.startswith(("python/mhc/_mhc_", "build/"))  # the extension, the build
        if target.is_file() and relative not in wanted and not kept:
            target.unlink()


def configure() -> None:
    if (BUILD / "CMakeCache.txt").exists():
        return
    command = [
        "cmake", "-S", str(TREE), "-B", str(BUILD), "-DCMAKE_BUILD_TYPE=Release", "-DMHC_BUILD_CUDA=OFF",
        "-DMHC_BUILD_BENCH=OFF", "-DMHC_BUILD_EXAMPLES=OFF", "-DMHC_BUILD_PYTHON=ON", "-DMHC_WERROR=ON",
        f"-DPython_EXECUTABLE={VENV_PYTHON}",
    ]  # fmt: skip
    # ccache: each mutation's build recompiles the previous mutation's file, restored to the text
    # the baseline compiled (a cache hit), besides its own.
    if shutil.which("ccache"):
        command.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
    result = run(command)
    if result.returncode != 0:
        sys.exit(f"mutate: configure failed\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


# The build targets: the C++ test binary and the Python extension (the FFI handlers).
CPP_TESTS_TARGET, EXTENSION_TARGET = "mhc_tests", "_mhc_cpu"


def build(targets=(CPP_TESTS_TARGET, EXTENSION_TARGET)) -> subprocess.CompletedProcess:
    jobs = str(os.cpu_count() or 2)
    result = run(["cmake", "--build", str(BUILD), "-j", jobs, "--target", *targets])
    if result.returncode == 0 and EXTENSION_TARGET in targets:
        for module in BUILD.glob("_mhc_cpu*.so"):
            shutil.copy2(module, TREE / "python" / "mhc" / module.name)
    return result


def cpp_stage(all_failures: bool = False) -> tuple[bool, str]:
    """True when every selected test passes; with the first failing test's name otherwise (with
    all_failures: the number of failing tests, and how many of them are bf16 cases)."""
    shards = 2
    with contextlib.ExitStack() as stack:
        # Files, not pipes: the shards run unread while they are polled below.
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(shards)]
        processes = []
        for index, log in enumerate(logs):
            env = dict(os.environ, GTEST_TOTAL_SHARDS=str(shards), GTEST_SHARD_INDEX=str(index))
            command = [str(BUILD / "mhc_tests"), "--gtest_brief=1", f"--gtest_filter={CPP_FILTER}"]
            if not all_failures:
                command.append("--gtest_fail_fast")
            processes.append(subprocess.Popen(command, env=env, text=True, stdout=log, stderr=subprocess.STDOUT))
        stopped = set()  # shards ended early: their sibling failed, and one failure decides the verdict
        while any(process.poll() is None for process in processes):
            if not all_failures and any(process.poll() not in (None, 0) for process in processes):
                for index, process in enumerate(processes):
                    if process.poll() is None:
                        process.kill()
                        stopped.add(index)
            time.sleep(0.1)
        passed, failures = True, []
        for index, (process, log) in enumerate(zip(processes, logs, strict=True)):
            process.wait()
            if process.returncode == 0 or index in stopped:
                continue
            passed = False
            log.seek(0)
            output = log.read()
            failures += [
                line.split("]", 1)[1].split(",")[0].strip()
                for line in output.splitlines()
                if line.startswith("[  FAILED  ]")
            ]
            if not failures:
                failures.append(f"exit {process.returncode}: {output.strip().splitlines()[-1:] or ''}")
    if all_failures and failures:
        bf16 = sum("bf16" in name for name in failures)
        return passed, f"{len(failures)} C++ tests ({bf16} of them bf16), first {failures[0]}"
    return passed, failures[0] if failures else ""


def python_stage(tests=tuple(PYTHON_TESTS)) -> tuple[bool, str]:
    # .venv's editable install puts a finder first on sys.meta_path that maps `mhc` to the main
    # tree whatever PYTHONPATH says; a sitecustomize (imported after the .pth files, in every
    # Python the tests start) removes it, so the copy's mhc is the one tested.
    site = WORK / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import sys\nsys.meta_path[:] = [f for f in sys.meta_path if type(f).__module__ != '_mhc_editable']\n"
    )
    path = os.pathsep.join((str(TREE / "python"), str(site)))
    # Without JAX's persistent compilation cache, whatever the caller's environment holds: its key
    # holds the program, not the extension's contents, so an entry compiled against another
    # mutation's (or the baseline's) extension could run in place of this one's.
    env = {key: value for key, value in os.environ.items() if key != "JAX_COMPILATION_CACHE_DIR"}
    env.update(PYTHONPATH=path, JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false")
    # Without hypothesis's pytest plugin: importing it costs each of these pytest processes about
    # 1.5 s of CPU, and the one hypothesis test (test_properties.py) sets its own settings.
    plugins = ["-p", "no:cacheprovider", "-p", "no:hypothesispytest"]
    command = [str(VENV_PYTHON), "-m", "pytest", "-q", "-x", *plugins, *tests]
    result = run(command, cwd=TREE, env=env)
    if result.returncode == 0:
        return True, ""
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
    return False, (failed[0][7:] if failed else f"pytest exit {result.returncode}")[:110]


def build_plan(mutation: Mutation) -> tuple[tuple[str, ...], bool]:
    """What a mutation rebuilds, and whether the C++ tests run: only what its edits can reach.

    Python files (the TPU kernels, mhc.jax): no build, no C++ tests. The FFI handlers (src/ffi/,
    compiled into the extension alone): the extension, no C++ tests. Other C++ files: the test
    binary, and the extension too when the Python stage runs. A target not rebuilt keeps the
    baseline's build, which is what the unmutated files compile to."""
    cpp_edits = [edit.path for edit in mutation.edits if not edit.path.endswith(".py")]
    if not cpp_edits:
        return (), False
    reaches_tests = any(not path.startswith("src/ffi/") for path in cpp_edits)
    targets = ((CPP_TESTS_TARGET,) if reaches_tests else ()) + ((EXTENSION_TARGET,) if mutation.python else ())
    return targets, reaches_tests


def apply(mutation: Mutation) -> dict[Path, str]:
    """Applies the edits in the copy; returns the original texts to restore."""
    originals: dict[Path, str] = {}
    for edit in mutation.edits:
        path = TREE / edit.path
        text = path.read_text()
        originals.setdefault(path, text)
        found = text.count(edit.old)
        if found != edit.count:
            restore(originals)
            sys.exit(f"mutate: {mutation.name}: expected {edit.count} x {edit.old!r} in {edit.path}, found {found}")
        path.write_text(text.replace(edit.old, edit.new))
    return originals


def restore(originals: dict[Path, str]) -> None:
    for path, text in originals.items():
        path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    parser.add_argument("--keep-going", action="store_true", help="run every mutation after a survivor")
    parser.add_argument("--all-failures", action="store_true", help="count every failing C++ test (slower)")
    args = parser.parse_args()
    names = {m.name for m in MUTATIONS}
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:44s} {m.description}")
        return 0
    unknown = set(args.only or []) - names
    if unknown:
        parser.error(f"unknown mutation(s) {sorted(unknown)}; --list shows them")
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if not VENV_PYTHON.exists():
        sys.exit(f"mutate: {VENV_PYTHON} is missing; `make python` creates it")

    started = time.monotonic()
    WORK.mkdir(exist_ok=True)
    sync_tree()
    configure()
    print("mutate: baseline build and tests (unmutated)", flush=True)
    result = build()
    if result.returncode != 0:
        sys.exit(f"mutate: the unmutated copy does not build\n{result.stdout[-3000:]}")
    python_tests = sorted({*PYTHON_TESTS, *(t for m in chosen if m.python for t in m.python_tests)})
    for stage_name, stage in (("C++", cpp_stage), ("Python", functools.partial(python_stage, python_tests))):
        passed, detail = stage()
        if not passed:
            sys.exit(f"mutate: the unmutated {stage_name} tests fail ({detail}); fix that first")
    print(f"mutate: baseline passes ({time.monotonic() - started:.0f} s)", flush=True)

    survivors = []
    for index, mutation in enumerate(chosen, 1):
        begun = time.monotonic()
        originals = apply(mutation)
        targets, run_cpp_tests = build_plan(mutation)
        try:
            result = build(targets) if targets else None
            if result is not None and result.returncode != 0:
                verdict, caught = "does not compile (fix the mutation)", False
            else:
                passed, detail = cpp_stage(args.all_failures) if run_cpp_tests else (True, "")
                if passed and mutation.python:
                    passed, detail = python_stage(mutation.python_tests)
                caught = not passed
                verdict = f"caught by {detail}" if caught else "SURVIVED"
        finally:
            restore(originals)
        print(
            f"[{index:2d}/{len(chosen)}] {mutation.name:44s} {time.monotonic() - begun:5.0f} s  {verdict}", flush=True
        )
        if not caught:
            survivors.append(mutation.name)
            if not args.keep_going:
                break
    build()  # leave the copy's build unmutated for the next run
    print(f"mutate: {len(chosen) - len(survivors)} caught, {len(survivors)} not, in {time.monotonic() - started:.0f} s")
    if survivors:
        print(f"mutate: not caught: {', '.join(survivors)} (write the test that catches it)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
