#!/usr/bin/env bash
# One GPU session's worth of checks and benchmarks, each under its own time limit so that one slow
# or failing part cannot starve the rest. Logs go to $OUT (or ./out). Usage:
#   COMMIT=$(git rev-parse --short HEAD) bash bench/gpu_session.sh [part ...]
# Carry .tcache (with triton-cache.tgz from the last call's $OUT) to reuse compiled kernels.
# "verify" expands to the GPU tests of code new since the last GPU run (see below).
# Parts (default: all, in this order): generate train engine kernels-tests kernels-bench decode-profile;
# tests:NAME runs tests/gpu/test_NAME_gpu.py alone (8 workers), e.g. tests:quant. Pytest runs are verbose
# so that a part cut by its limit still names its failures in the log.
set -u
export PYTHONPATH="${PYTHONPATH:-$PWD}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Autotuning results join the compiled kernels in the Triton cache, so a carried cache skips both.
export TRITON_CACHE_AUTOTUNING=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-out}"; mkdir -p "$OUT"
# A fresh machine compiles and autotunes every kernel again: a cache from an earlier call of the same
# machine type (.tcache/triton-cache.tgz, carried) is restored first, and the cache goes back in $OUT.
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/tcache}"; mkdir -p "$TRITON_CACHE_DIR"
[ -f .tcache/triton-cache.tgz ] && tar xzf .tcache/triton-cache.tgz -C "$TRITON_CACHE_DIR" 2>/dev/null
save_cache() {  # at most 15 MiB comes back (the transfer limit is 16 MiB a file)
  tar czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
  [ "$(stat -c %s "$OUT/triton-cache.tgz" 2>/dev/null || echo 0)" -le $((15 << 20)) ] || rm -f "$OUT/triton-cache.tgz"
}
trap save_cache EXIT
# Packages the GPU image lacks (the server's starlette, uvicorn, httptools and uvloop) travel as wheels
# in $WHEELS (default .whl), fetched where pip has the network with `make offline-wheels` (their own
# needs are on the image).
WHEELS="${WHEELS:-.whl}"
if ls "$WHEELS"/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(generate train engine kernels-tests kernels-bench decode-profile)
# "verify": the GPU tests of code that has not yet run on a GPU, before any benchmark.
expanded=(); for p in "${parts[@]}"; do
  case $p in verify) expanded+=(tests:engine tests:attention tests:core tests:kernels tests:server) ;;
             *) expanded+=("$p") ;; esac
done; parts=("${expanded[@]}")
run() {  # name, seconds (LIMIT_<name> overrides), command...
  local name=$1 var="LIMIT_${1//-/_}"; local limit=${!var:-$2}; shift 2
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "=== $name exit $?"
  grep -v '^JSON\|it/s]\|Writing model shards\|Loading weights\| PASSED\|PytestBenchmarkWarning\|warner(' \
    "$OUT/$name.log" | tail -n 25
}
for part in "${parts[@]}"; do
  case $part in
    generate) run generate 150 python3 bench/generate.py --workloads W1,W3 \
                --variants sdpa,triton+kernels,triton+kernels+cublas --json "$OUT/results.jsonl" ;;
    train) run train 110 python3 bench/train.py --kernels off,on --attn sdpa --json "$OUT/results.jsonl" ;;
    engine) run engine 90 python3 bench/serve_offline.py --skip-hf --json "$OUT/results.jsonl" ;;
    engine-hf) run engine-hf 240 python3 bench/serve_offline.py --json "$OUT/results.jsonl" ;;
    quant-kernels) run quant-kernels 120 python3 bench/quant.py --parts kernels,tiles --shapes qwen3-8b ;;
    load) run load 120 python3 bench/load.py ;;
    engine-profile) run engine-profile 70 python3 bench/profile_engine.py ;;
    kernels-tests) run kernels-tests 90 python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider tests/gpu/test_kernels_gpu.py ;;
    kernels-bench) run kernels-bench 60 python3 bench/kernel_speed.py ;;
    kernels-bench-extra) run kernels-bench-extra 120 python3 bench/kernel_speed.py --extra ;;
    decode-profile) run decode-profile 60 python3 bench/profile_decode.py --attn triton --kernels ;;
    decode-kernels) run decode-kernels 40 python3 bench/decode_kernels.py ;;
    fusion-tests) run fusion-tests 90 python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider \
                    tests/gpu/test_decode_fusion_gpu.py tests/gpu/test_kernels_gpu.py ;;
    gpu-tests) run gpu-tests 300 python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider --timeout 120 tests/gpu ;;
    generate-ours) run generate-ours 150 python3 bench/generate.py --skip-hf --workloads W1,W3 \
                     --variants triton+kernels --check-eager --json "$OUT/results.jsonl" ;;
    decode-profile-32) run decode-profile-32 60 python3 bench/profile_decode.py --attn triton --kernels --batch 32 ;;
    quant) run quant 160 python3 bench/quant.py --shapes qwen3-0.6b,qwen3-8b --json "$OUT/results.jsonl" ;;
    w2w3) run w2w3 240 python3 bench/generate.py --workloads W2,W3 --variants triton+kernels --hf-cache dynamic \
            --json "$OUT/results.jsonl" ;;
    train-ours) run train-ours 50 python3 bench/train.py --skip-hf --kernels on --attn sdpa --json "$OUT/results.jsonl" ;;
    train-profile) run train-profile 60 python3 bench/profile_train.py ;;
    train-profile-triton) run train-profile-triton 60 python3 bench/profile_train.py --attn triton ;;
    host-profile) run host-profile 60 python3 bench/profile_host.py --attn triton --kernels ;;
    serve-online) run serve-online 90 python3 bench/serve_online.py --json "$OUT/results.jsonl" ;;
    tests-stable) run tests-stable 90 python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider -n 8 --timeout 100 \
                    tests/gpu/test_quant_gpu.py tests/gpu/test_train_gpu.py tests/gpu/test_device_gpu.py \
                    tests/gpu/test_mamba_bwd_gpu.py tests/gpu/test_server_gpu.py tests/gpu/test_core_gpu.py \
                    tests/gpu/test_engine_gpu.py ;;
    skinny) run skinny 60 python3 bench/skinny_gemm.py ;;
    skinny-knobs) run skinny-knobs 240 python3 bench/skinny_gemm.py --knobs --m 32 16 --models 0.6b ;;
    stages-ab) run stages-ab 330 python3 bench/generate.py --skip-hf --workloads W3 --variants \
                 triton+kernels,triton+kernels+alone3,triton+kernels+alone4,triton+kernels,triton+kernels+alone3,triton+kernels+alone4 ;;
    skinny-sweep-32) run skinny-sweep-32 300 python3 bench/skinny_gemm.py --m 32 --models 0.6b --sweep ;;
    skinny-tests) run skinny-tests 120 python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider tests/gpu/test_skinny_gemm_gpu.py ;;
    paged-decode-engine) run paged-decode-engine 60 python3 bench/paged_decode.py --sweep --batches 128,256 \
                           --contexts 400,800 --pages 16 ;;
    engine-kernels) run engine-kernels 90 python3 bench/profile_engine.py --kernels ;;
    paged-decode) run paged-decode 60 python3 bench/paged_decode.py --sweep ;;
    new-kernel-tests) run new-kernel-tests 80 python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider -n 8 --timeout 90 \
                        tests/gpu/test_pdl_gpu.py tests/gpu/test_skinny_gemm_gpu.py tests/gpu/test_attention_gpu.py \
                        tests/gpu/test_core_gpu.py tests/gpu/test_engine_gpu.py -k "not test_forward_full_size \
                        and not test_backward_full_size and not test_backends_match and not test_paged_prefill" ;;
    w2) run w2 70 python3 bench/generate.py --workloads W2 --variants triton+kernels --hf-cache dynamic \
          --json "$OUT/results.jsonl" ;;
    quant-8b) run quant-8b 100 python3 bench/quant.py --parts decode,qlora --shapes qwen3-8b \
                --methods bf16,int8,int4,nf4 --json "$OUT/results.jsonl" ;;
    quant-mma) run quant-mma 300 python3 bench/quant.py --parts mma --shapes qwen3-8b --methods "${QUANT_MMA_METHODS:-int4,int8}" \
                 ${QUANT_MMA_TILES:+--mma-tiles "$QUANT_MMA_TILES"} ${QUANT_MMA_M:+--mma-m "$QUANT_MMA_M"} \
                 --json "$OUT/results.jsonl" ;;
    quant-mma-decode) run quant-mma-decode 240 python3 bench/quant.py --parts decode --shapes qwen3-8b \
                        --methods "${QUANT_METHODS:-bf16,int4,int4_fma,int4_head,int8,int8_fma}" --json "$OUT/results.jsonl" ;;
    quant-head) run quant-head 120 python3 bench/quant.py --parts decode --shapes qwen3-8b \
                  --methods bf16,int4,int4_head,int8,int8_head --json "$OUT/results.jsonl" ;;
    quant-ncu) run quant-ncu 240 ncu --clock-control none --profile-from-start off --section SpeedOfLight \
                 --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
                 --section MemoryWorkloadAnalysis --print-details all \
                 python3 bench/profile_quant.py ${QUANT_NCU_ARGS:-} ;;
    # The fragment GEMV (batch 1's int4/int8 kernel) never had a hardware profile: where its warps stall.
    quant-ncu-frag) run quant-ncu-frag 200 ncu --clock-control none --profile-from-start off --section SpeedOfLight \
                      --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
                      --section MemoryWorkloadAnalysis --section SourceCounters --print-details all \
                      python3 bench/profile_quant.py --layers qkv,o,gate_up,down --kernels frag,bf16 ;;
    decode-profile-int4) run decode-profile-int4 120 python3 bench/profile_decode.py --shape qwen3-8b --kernels \
                           --quant int4 ;;
    generate-overhead) run generate-overhead 90 python3 bench/generate_overhead.py ;;
    generate-phases) run generate-phases 60 python3 bench/generate_overhead.py --phases --top 40
                     run generate-phases-32 60 python3 bench/generate_overhead.py --phases --top 40 --batch 32 ;;
    gemv-tiles) run gemv-tiles 420 python3 bench/gemv_tiles.py --json "$OUT/results.jsonl" ;;
    multi) n=$(nvidia-smi -L | wc -l)  # every GPU of the machine (bench/distributed.py); on one GPU it checks the scripts
           # How the GPUs are linked, and which transport NCCL picks (run 17's 2-GPU DDP scaled at 56%)
           nvidia-smi topo -m > "$OUT/topology.log" 2>&1; cat "$OUT/topology.log"
           run multi-train-single 240 python3 bench/distributed.py train --strategy single --json "$OUT/multi.jsonl"
           for s in ddp fsdp tp; do
             run "multi-train-$s" 240 env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT torchrun --nproc_per_node="$n" bench/distributed.py train --strategy "$s" \
               --json "$OUT/multi.jsonl"
           done
           run multi-infer-tp 300 torchrun --nproc_per_node="$n" bench/distributed.py infer-tp --json "$OUT/multi.jsonl"
           run multi-infer-tp-int4 300 torchrun --nproc_per_node="$n" bench/distributed.py infer-tp --quant int4 \
             --json "$OUT/multi.jsonl"
           run multi-device-map 200 python3 bench/distributed.py device-map --json "$OUT/multi.jsonl"
           [ "$n" -ge 2 ] && run multi-device-map-swapped 200 env CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=1,0 \
             python3 bench/distributed.py device-map --shape qwen3-0.6b --json "$OUT/multi.jsonl"
           python3 bench/distributed.py report --json "$OUT/multi.jsonl" ;;
    stopcheck-ab) run stopcheck-ab 240 python3 bench/generate.py --skip-hf --workloads W1,W3 --variants \
                    triton+kernels,triton+kernels+drainstop,triton+kernels+lag16,triton+kernels,triton+kernels+drainstop,triton+kernels+lag16 --json "$OUT/results.jsonl" ;;
    inputs-ab) run inputs-ab 150 python3 bench/generate.py --skip-hf --workloads W1,W3 --check-eager \
                 --variants triton+kernels,triton+kernels+torchinputs,triton+kernels --json "$OUT/results.jsonl" ;;
    l2-upside) run l2-upside 60 python3 bench/l2_upside.py ;;
    # The switches not yet measured (bench/RESULTS.md "Not yet run on a GPU"): the fragment GEMV's unmasked
    # loads, then the batch-1 paged decode's spill-free tiles, alone and with qk_norm_rope fused in.
    unmasked-ab) run unmasked-bench 200 python3 bench/quant_gemv_mma.py --unmasked
                 run unmasked-decode 200 python3 bench/quant.py --parts decode --shapes qwen3-8b --methods \
                   bf16,int4,int4_unmasked,int8,int8_unmasked --json "$OUT/results.jsonl" ;;
    # How the fragment GEMV's blocks of weights load (quant_gemv_mma.LOADS; bench/sass_schedule.py shows each
    # in SASS): in registers as measured (no letter), past a fence a block (p: read-only loads, c: coherent
    # loads, which SASS issues exactly DEPTH blocks ahead), or through shared memory (s: with x, w: weights
    # only). frag-tests checks the new plans against the reference; frag-bench times every variant on
    # qwen3-8b's layers and writes the fastest per layer; frag-decode runs the decode with those plans.
    frag-tests) run frag-tests 240 python3 -m pytest -q -rfE --tb=line -m gpu -p no:cacheprovider -n 8 \
                  tests/gpu/test_quant_gpu.py -k "fragment_gemv_matches_reference or gated_fragment_gemv" ;;
    frag-bench) run frag-bench 540 python3 bench/quant_gemv_mma.py --formats int4,int8 --best "$OUT/plans.json" \
                  --layers "${LAYERS:-qkv,o,gate_up,down}" \
                  --variants "${VARIANTS:-16,1,1;8,1,2;8,2,1;16,1,2;8,1,3;16,1,1,p;8,1,2,p;8,2,1,p;16,1,2,p;16,1,1,c;8,1,2,c;8,2,1,c;16,1,2,c;8,1,3,c;16,1,3,c;8,2,2,c;8,2,2,s;16,1,2,w;8,2,2,w;8,1,3,w}${EXTRA_VARIANTS:+;$EXTRA_VARIANTS}" ;;
    frag-decode) run frag-decode 400 python3 bench/quant.py --parts decode --shapes qwen3-8b --plans "${PLANS:-$OUT/plans.json}" \
                   --methods "${FRAG_METHODS:-bf16,int4,int4_plans,int8,int8_plans,int4_head_plans}" --json "$OUT/results.jsonl" ;;
    # The W2 decode at the defaults, with the lm_head quantized too (METHODS overrides the list).
    quant-decode) run quant-decode 300 python3 bench/quant.py --parts decode --shapes qwen3-8b \
                    --methods "${METHODS:-bf16,int4,int8,int4_head,int8_head}" --json "$OUT/results.jsonl" ;;
    quant-model-tests) run quant-model-tests 240 python3 -m pytest -q -rfE --tb=line -m gpu -p no:cacheprovider -n 8 \
                         tests/gpu/test_quant_gpu.py -k "model or gated_fragment_gemv or fragment_gemv_matches_reference" ;;
    quant-gated-tests) run quant-gated-tests 240 python3 -m pytest -q -rfE --tb=line -m gpu -p no:cacheprovider -n 8 \
                         tests/gpu/test_quant_gpu.py -k "gated or load_switches" ;;
    quant-gated-ab) run quant-folds 60 python3 bench/quant_gemv_mma.py --folds
                    run quant-gated-ab 420 python3 bench/quant.py --parts decode --shapes qwen3-8b --methods \
                      bf16,int4,int4_nogated,int4_nowide,int4_fold,int4_head,int8,int8_gated,int8_fold,int8_head,bf16 \
                      --json "$OUT/results.jsonl" ;;
    lat-ab) run lat-ab 300 python3 bench/generate.py --skip-hf --workloads W1 --check-eager --variants \
              triton+kernels,triton+kernels+lat8.64.3,triton+kernels+fuseattnpdl+lat8.64.3,triton+kernels+lat4.64.3,\
triton+kernels+fuseattnpdl,triton+kernels+lat8.128.2,triton+kernels \
              --json "$OUT/results.jsonl" ;;
    w3-ab) run w3-ab 240 python3 bench/generate.py --skip-hf --workloads W3 --variants \
             triton+kernels,triton+kernels+skinny50,triton+kernels+skinny100,triton+kernels+split128.1.3,\
triton+kernels+split128.1.2,triton+kernels+split256.2.4,triton+kernels --json "$OUT/results.jsonl" ;;
    paged-decode-32) run paged-decode-32 120 python3 bench/paged_decode.py --sweep --batches 32 --contexts 130,260,384 \
                       --pages 256 ;;
    w3-skinny) run w3-skinny 200 python3 bench/generate.py --skip-hf --workloads W3 --variants \
                 triton+kernels,triton+kernels+skinny20,triton+kernels+skinny10,triton+kernels+skinny20,triton+kernels \
                 --json "$OUT/results.jsonl" ;;
    gated-ab) run gated-ab 200 python3 bench/generate.py --skip-hf --workloads W3 --check-eager --variants \
                triton+kernels,triton+kernels+nogated,triton+kernels,triton+kernels+nogated --json "$OUT/results.jsonl" ;;
    fuseattn-ab) run fuseattn-ab 200 python3 bench/generate.py --skip-hf --workloads W3 --check-eager --variants \
                   triton+kernels,triton+kernels+fuseattnpdl,triton+kernels,triton+kernels+fuseattnpdl \
                   --json "$OUT/results.jsonl" ;;
    fold-ab) run fold-ab 200 python3 bench/generate.py --skip-hf --workloads W1,W2,W3 \
               --variants triton+kernels,triton+kernels+nofold --json "$OUT/results.jsonl" ;;
    attention-graph) run attention-graph 200 python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider -n 8 \
                       --timeout 150 tests/gpu/test_attention_gpu.py -k "paged or graph" ;;
    tests:*) f=${part#tests:}; run "tests-$f" 240 python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider \
               -n 8 --timeout 120 "tests/gpu/test_${f}_gpu.py" ;;
    *) echo "unknown part $part" ;;
  esac
done
