#!/usr/bin/env bash
# The last verification on the H200 within a small device-time budget: build the extension, run the self-check
# (`python -m attnlib`), then the highest-priority GPU tests (those never run before first), verbose so that a run cut
# short still reports each finished test.
# Usage: bash benchmarks/run_final_h200.sh OUT_DIR [pytest seconds]
set -uo pipefail
out=${1:?output directory}; seconds=${2:-140}
bash benchmarks/run_cudnn_h200.sh "$out" build > "$out/build_summary.log" 2>&1 || { tail -20 "$out/build_summary.log"; exit 1; }
tail -3 "$out/build_summary.log"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/attnlib_meta"  # attnlib's metadata, installed by the build step
timeout 60 python3 -m attnlib 2>&1 | tee "$out/selfcheck.log"
g=tests/test_cudnn_gpu.py; r=tests/test_cudnn_ragged_gpu.py; c=tests/test_context_parallel_gpu.py
tests=(
  "$g::test_dropout_same_mask_forward_and_backward[bf16-causal]" "$g::test_dropout_same_mask_forward_and_backward[f16-causal]"
  "$r::test_paged_cache_decoding_matches_dense_causal" "$r::test_bucket_boundaries_and_graph_reuse"
  "$r::test_segment_count_overflow_gives_nan_rows" "$r::test_segments_cross_attention_bottom_right"
  "$r::test_thd_dropout_same_mask_forward_and_backward" "$r::test_paged_gradients_raise_explicitly_and_fall_back_automatically"
  "$r::test_thd_matches_reference[mla_causal-bf16]" "$r::test_thd_matches_reference[odd_lengths_full-bf16]"
  "$r::test_paged_matches_reference[prefill_bottom_right-lse]" "$r::test_paged_matches_reference[prefill_mla-lse]"
  "$r::test_paged_matches_reference[prefill_window-lse]" "$r::test_paged_matches_reference[decode_gqa-lse]"
  "$c::test_per_step_runs_on_cudnn_and_matches_reference[causal-balanced-ring]"
  "$c::test_per_step_runs_on_cudnn_and_matches_reference[causal-balanced-all_gather]"
  "$c::test_per_step_runs_on_cudnn_and_matches_reference[window-contiguous-ring]"
  "$c::test_per_step_runs_on_cudnn_and_matches_reference[full-contiguous-all_gather]"
  "$g::test_matches_reference[mha-bf16]" "$g::test_matches_reference[gqa_causal-bf16]"
  "$g::test_matches_reference[mla_causal-bf16]" "$g::test_matches_reference[causal_bottom_right_t_gt_s-bf16]"
  "$g::test_matches_reference[window_two_sided-bf16]" "$g::test_padding_lengths[causal_bottom_right-bf16]"
  "$g::test_bias_and_dbias[BNTS-bf16]" "$g::test_lse_gradient[bf16]" "$g::test_auto_dispatch_picks_cudnn"
  "$g::test_vmap_is_one_fused_call_and_matches"
  "tests/test_equinox.py::test_gpu_cudnn_core_and_layer_under_vmap" "tests/test_haiku.py::test_gpu_cudnn_layer_matches_xla"
)
XLA_PYTHON_CLIENT_PREALLOCATE=false ATTNLIB_REQUIRE_GPU=1 ATTNLIB_CACHE_DIR=/tmp/attnlib_cache timeout "$seconds" python3 -m pytest -p no:benchmark \
  -p no:cacheprovider -n 8 --dist load -v -rfE --tb=short "${tests[@]}" 2>&1 | tee "$out/gpu_tests.log" \
  | grep -E "PASSED|FAILED|ERROR|passed|failed|error" | tail -45
