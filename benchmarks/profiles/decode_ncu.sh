#!/usr/bin/env bash
# Nsight Compute on one launch of the CUDA backend's tensor-core decode (fp8kv_paged_attention_mma) in the
# default mode and in the FP8 attention mode (dynamic q_scale), at one decode shape (default B=64 L=2048;
# GQA 32/8, D=128, block 16, e4m3 per-tensor cache, bf16 queries): DRAM and L2 throughput, issue activity,
# pipe utilisation, stall reasons per issued instruction, and a source page (warp-state samples by SASS
# line) of each: where the FP8 mode's time over the default mode goes.
# Usage: bash benchmarks/profiles/decode_ncu.sh OUT_DIR [B:L]
set -uo pipefail
out=$1
shape=${2:-64:2048}
stalls=""
for s in barrier short_scoreboard long_scoreboard wait math_pipe_throttle mio_throttle not_selected selected \
         dispatch_stall lg_throttle branch_resolving no_instruction misc sleeping; do
  stalls+="smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio,"
done
metrics="${stalls}gpu__time_duration.sum,smsp__inst_executed.sum,sm__issue_active.avg.pct_of_peak_sustained_active,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors.avg.pct_of_peak_sustained_elapsed,\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,\
sm__warps_active.avg.pct_of_peak_sustained_active"
for mode in default fp8_dynamic_q; do
  ncu --kernel-name fp8kv_paged_attention_mma --launch-skip 1 --launch-count 1 --print-details all \
    --section SpeedOfLight --section SourceCounters --metrics "$metrics" \
    python benchmarks/decode.py --profile "$mode" --shapes "$shape" > "$out/ncu_decode_${mode}.txt" 2>&1
  ncu --kernel-name fp8kv_paged_attention_mma --launch-skip 1 --launch-count 1 --section SourceCounters \
    --section WarpStateStats --section InstructionStats -f -o "/tmp/decode_${mode}" \
    python benchmarks/decode.py --profile "$mode" --shapes "$shape" > /dev/null 2>&1
  ncu -i "/tmp/decode_${mode}.ncu-rep" --page source --csv --print-source sass | gzip > "$out/ncu_decode_${mode}_sass.csv.gz"
done
