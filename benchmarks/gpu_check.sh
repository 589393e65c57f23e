#!/usr/bin/env bash
# Every GPU path of brickyard in one go, for a machine with CUDA (and the GPU figures of
# docs/benchmarks.md). Prints everything and keeps a copy in OUT/gpu_check.log.
#
#   bash benchmarks/gpu_check.sh [OUT]          # OUT defaults to runs/gpu-check
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_EPOCHS=0.1 GPU_CHECK_ROUNDS=2 GPU_CHECK_RUNS=1 GPU_CHECK_COMPILE_STEPS=2 \
#       bash benchmarks/gpu_check.sh /tmp/x
#                                               # a short dry run of the same steps on CPU
#
# Runs from a checkout without installing (PYTHONPATH=src); MNIST comes from $BRICKYARD_DATA or is
# downloaded. Steps: 1 epoch at fp32, bf16 and fp16 (GradScaler) on one GPU; torchrun + NCCL with
# one process per GPU (2 when there are 2; the parameter server on 3); `brickyard bench` scaling; `brickyard memory` estimate
# vs the measured peak; the overhead ratios (small nets, ResNet-18, ResNet-50); the step with and without CUDA graphs; ResNet-50 with
# train.compile: auto against eager; FSDP on two devices where there are two; the time to 99%.
# Where Fashion-MNIST is found ($BRICKYARD_DATA, /usr/share/datasets): the GPU recipes `fashion-resnet18` and
# `d2l-resnet18`, the `fashion` preset, and every strong augmentation on the device (mixup, cutmix,
# RandAugment, random erasing, drop path). GPU_CHECK_PARTS="fashion" or "main" runs one part only.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
EPOCHS=${GPU_CHECK_EPOCHS:-1}
ROUNDS=${GPU_CHECK_ROUNDS:-10}   # overhead rounds
TTA_RUNS=${GPU_CHECK_RUNS:-3}    # time-to-accuracy runs
PARTS=${GPU_CHECK_PARTS:-fashion main}
FASHION_STEPS=${GPU_CHECK_FASHION_STEPS:-}  # a number: each Fashion-MNIST recipe stops after that many steps (dry runs)
COMPILE_STEPS=${GPU_CHECK_COMPILE_STEPS:-1000}  # steps of the train.compile comparison
RUNS=$(mktemp -d)
exec > >(tee "$OUT/gpu_check.log") 2>&1

failed=0
step() {  # step NAME COMMAND...: run, time, and report; a failure is counted, not fatal
    local name=$1; shift
    echo; echo "=== $name: $*"
    local start=$SECONDS
    if "$@"; then echo "=== $name: ok ($((SECONDS - start)) s)"; else echo "=== $name: FAILED rc=$? ($((SECONDS - start)) s)"; failed=$((failed + 1)); fi
}
passes() { $PY -c "import json,sys; s=json.load(open(sys.argv[1])); print('  -> compiled', s.get('compiled'), 'pass seconds', [round(x, 2) for x in s.get('epoch_seconds', [])])" "$1/summary.json"; }
result() { $PY -c "import json,sys; s=json.load(open(sys.argv[1])); print('  ->', {k: s.get(k) for k in ('test_accuracy', 'images_per_second', 'train_seconds', 'precision', 'world_size', 'device')})" "$1/summary.json"; }

$PY - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, bf16 {torch.cuda.is_bf16_supported()}")
EOF
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$DEVICE" = cpu ]; then ONE=cpu; TWO=cpu:2; PRECISIONS="fp32"; NGPU=2
else ONE=0; TWO=0,1; PRECISIONS="fp32 bf16 fp16"; fi

if [[ " $PARTS " == *" fashion "* ]]; then
    if $PY -m brickyard data info fashion-mnist >/dev/null 2>&1; then
        SHORT=(); [ -n "$FASHION_STEPS" ] && SHORT=(--set train.epochs=0 --set train.max_steps="$FASHION_STEPS")
        for preset in fashion-resnet18 d2l-resnet18 fashion; do
            step "$preset" $PY -m brickyard train $preset --device "$DEVICE" --run-dir "$RUNS/$preset" --set train.progress=none "${SHORT[@]}"
            [ -f "$RUNS/$preset/summary.json" ] && result "$RUNS/$preset"
        done
        step "strong augmentation on the device (fashion-resnet18, 200 steps)" $PY -m brickyard train fashion-resnet18 \
            --device "$DEVICE" --run-dir "$RUNS/augment" --set data.mixup=0.8 --set data.cutmix=1.0 \
            --set data.rand_augment=n2-m9 --set data.random_erasing=0.25 --set model.drop_path=0.1 \
            --set train.epochs=0 --set train.max_steps="${FASHION_STEPS:-200}" --set train.progress=none
        [ -f "$RUNS/augment/summary.json" ] && result "$RUNS/augment"
    else
        echo "(Fashion-MNIST not found: apt-get install dataset-fashion-mnist, or set BRICKYARD_DATA)"
    fi
fi
[[ " $PARTS " == *" main "* ]] || { rm -rf "$RUNS"; echo; echo "gpu_check: $failed step(s) failed; log in $OUT/gpu_check.log"; exit $((failed > 0)); }

for p in $PRECISIONS; do
    step "train $p" $PY -m brickyard train --device "$DEVICE" --run-dir "$RUNS/$p" --set train.precision=$p --set train.epochs=$EPOCHS --set train.progress=none
    [ -f "$RUNS/$p/summary.json" ] && result "$RUNS/$p"
done
step "torchrun, 1 process ($ONE)" $PY -m brickyard train --devices $ONE --run-dir "$RUNS/ddp1" --set train.epochs=$EPOCHS
[ -f "$RUNS/ddp1/summary.json" ] && result "$RUNS/ddp1" && tail -n 3 "$RUNS/ddp1/logs/workerlog.0"
if [ "$NGPU" -ge 2 ]; then
    step "torchrun, 2 processes ($TWO)" $PY -m brickyard train --devices $TWO --run-dir "$RUNS/ddp2" --set train.epochs=$EPOCHS
    [ -f "$RUNS/ddp2/summary.json" ] && result "$RUNS/ddp2"
    step "bench scaling" $PY -m brickyard bench mnist --devices $ONE $TWO --out "$OUT/bench"
    if [ "$NGPU" -ge 3 ] || [ "$DEVICE" = cpu ]; then
        THREE=$([ "$DEVICE" = cpu ] && echo cpu:3 || echo 0,1,2)
        step "parameter server, 2 trainers + 1 server ($THREE)" $PY -m brickyard train --devices $THREE --run-dir "$RUNS/ps" --set train.epochs=$EPOCHS --set dist.mode=ps
        [ -f "$RUNS/ps/summary.json" ] && result "$RUNS/ps"
    fi
else
    echo "(one GPU: no 2-process NCCL run)"
    step "bench" $PY -m brickyard bench mnist --devices $ONE --out "$OUT/bench"
fi
step "memory mnist" $PY -m brickyard memory mnist --devices $ONE
step "memory resnet18 (synthetic data)" $PY -m brickyard memory fashion-resnet18 --devices $ONE --set data.name=synthetic
step "overhead" $PY benchmarks/overhead.py --device "$DEVICE" --rounds "$ROUNDS"
[ "$DEVICE" = cpu ] || step "the step five ways (CUDA graphs)" $PY benchmarks/cuda_graphs.py --rounds 3 --skip reduce-overhead
if [ "$DEVICE" = cpu ]; then BIG="--rounds 2 --steps 2"; else BIG="--rounds $ROUNDS --steps 20"; fi
step "overhead resnet18 (32 px)" $PY benchmarks/overhead.py --device "$DEVICE" --case resnet18 $BIG
step "overhead resnet50 (224 px)" $PY benchmarks/overhead.py --device "$DEVICE" --case resnet50 $BIG $([ "$DEVICE" = cpu ] || echo --batch 128)
# train.compile: true against eager on a ResNet-50 (synthetic 224 px images, 1,000 steps, 32 a pass): the first
# pass holds the compilation, the median of the others is the steady pass; from both, where compiling pays
for c in false true; do
    step "resnet50 train.compile=$c" $PY -m brickyard train --device "$DEVICE" --run-dir "$RUNS/compile-$c" \
        --set model.name=resnet50 --set data.name=synthetic --set data.synthetic.channels=3 \
        --set data.synthetic.height=224 --set data.synthetic.width=224 --set data.synthetic.num_train=4096 \
        --set data.synthetic.num_val=64 --set data.synthetic.num_test=64 \
        --set data.global_batch_size=$([ "$DEVICE" = cpu ] && echo 8 || echo 128) --set train.max_steps=$COMPILE_STEPS \
        --set train.epochs=0 --set train.compile=$c --set train.progress=none --set train.plots=false
    [ -f "$RUNS/compile-$c/summary.json" ] && result "$RUNS/compile-$c" && passes "$RUNS/compile-$c"
done
$PY - "$RUNS/compile-false" "$RUNS/compile-true" <<'EOF'
import json, statistics, sys
try:
    (e0, *e), (c0, *c) = (json.load(open(d + "/summary.json"))["epoch_seconds"] for d in sys.argv[1:])
    se, sc = statistics.median(e), statistics.median(c)
    print(f"  -> a pass of 32 steps: eager {se:.2f} s, compiled {sc:.2f} s ({se / sc:.2f}x); compiling cost "
          f"{c0 - sc - (e0 - se):.1f} s more than eager's first pass"
          + (f": pays after about {32 * (c0 - sc - (e0 - se)) / (se - sc):,.0f} steps" if se > sc else ": never pays"))
except (OSError, KeyError, ValueError) as exc:
    print("  -> no compile comparison:", exc)
EOF
# FSDP under torchrun, one process per device (one device has nothing to shard), vit_small on 64 px images
if [ "$NGPU" -ge 2 ]; then
    step "FSDP, vit_small ($TWO)" $PY -m brickyard train --devices $TWO --run-dir "$RUNS/fsdp" --set dist.strategy=fsdp \
        --set model.name=vit_small --set data.name=synthetic --set data.synthetic.channels=3 --set data.synthetic.height=64 \
        --set data.synthetic.width=64 --set data.synthetic.num_train=8192 --set data.synthetic.num_val=64 \
        --set data.synthetic.num_test=64 --set train.max_steps=$COMPILE_STEPS --set train.epochs=0 --set train.eval_every=0 \
        --set train.progress=none --set train.plots=false
    [ -f "$RUNS/fsdp/summary.json" ] && result "$RUNS/fsdp" && $PY -c "import json,sys; s=json.load(open(sys.argv[1])); print('  ->', {k: s.get(k) for k in ('strategy', 'held_per_rank', 'peak_device_memory_mb', 'peak_host_rss_mb')})" "$RUNS/fsdp/summary.json"
else
    echo "(one GPU: FSDP has nothing to shard; its tests run on CPU processes)"
fi
step "time to accuracy" $PY benchmarks/time_to_accuracy.py --runs "$TTA_RUNS" -- --device "$DEVICE"
rm -rf "$RUNS"
echo; echo "gpu_check: $failed step(s) failed; log in $OUT/gpu_check.log"
exit $((failed > 0))
