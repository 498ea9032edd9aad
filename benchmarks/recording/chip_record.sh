#!/usr/bin/env bash
# The recorder's cases on a machine with a TPU v5e. Run from the repository root after
# `. benchmarks/tpu_chip_setup.sh`; writes $OUT/record.tgz (one folder per case, with the
# program's log and `jaxmem record`'s recording).
#   bash benchmarks/recording/chip_record.sh [cases...]   (default: all)
set -u
OUT=${OUT:-/tmp/out}
R=$OUT/rec
mkdir -p "$R"
rec() {  # rec NAME COMMAND...: the command under jaxmem record, its exit code noted
  local name=$1; shift
  timeout "${T:-300}" python3 -m jaxmem record --out "$R/$name" -- "$@" >"$R/$name.log" 2>&1
  echo "$name exit $?" >>"$R/exits.txt"
}
plain() {  # plain NAME COMMAND...: the same without recording
  local name=$1; shift
  timeout "${T:-300}" "$@" >"$R/$name.log" 2>&1
  echo "$name exit $?" >>"$R/exits.txt"
}
cases=${*:-"leak e0101 e0100 hbm gpt2"}
for c in $cases; do
  case $c in
    leak) rec leak python3 benchmarks/recording/leak_loop.py 24 ;;
    e0101) rec e0101 python3 benchmarks/recording/hold_then_load.py 14 ;;
    e0100) rec e0100 python3 benchmarks/recording/alloc_until_oom.py ;;
    hbm) rec hbm python3 benchmarks/recording/compile_hbm.py "$R/hbm_error.txt" ;;
    gpt2)  # without and with recording, alternately, for the overhead
      for i in $(seq 1 "${PAIRS:-2}"); do
        plain "gpt2_plain$i" python3 benchmarks/recording/gpt2_train.py --batch 8 --steps 30 --times "$R/gpt2_plain$i.json"
        rec "gpt2_rec$i" python3 benchmarks/recording/gpt2_train.py --batch 8 --steps 30 --times "$R/gpt2_rec$i.json"
      done ;;
  esac
done
tar czf "$OUT/record.tgz" -C "$OUT" rec
cat "$R/exits.txt"
