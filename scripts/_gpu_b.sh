export PYTHONPATH=src PYTHONWARNINGS=ignore
LOWBIT_AUTOTUNE=0 timeout 150 python -m pytest -q -p no:cacheprovider -m gpu -n 4 --maxfail=3 -rfE --tb=short tests/ops/test_residual.py tests/ops/test_norm_quant.py tests/train tests/nn/test_swiglu_mlp_fused.py > $OUT/t.txt 2>&1
rc=$?; tail -c 2500 $OUT/t.txt
if [ $rc -eq 0 ]; then
  timeout 200 python -m lowbit train --model 1.3b --recipe fp8-block --steps 20 --batch-size 4 --seq-len 2048 \
    --eval-every 20 --eval-windows 8 --no-progress --compare bf16 --out-dir $OUT/b13 2>&1 | grep -v "^\[lowbit\]" | tail -8
fi
