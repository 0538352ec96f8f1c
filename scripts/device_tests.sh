#!/bin/bash
# Run GPU tests and benches on a lent GPU machine (torch and triton preinstalled, no network).
# Usage, from the checkout's root with the wheels of isoaudit's pure-Python dependencies in .whl/:
#   bash scripts/device_tests.sh pytest -m gpu tests/kernels/test_fp8.py
#   bash scripts/device_tests.sh python bench/rl_loop_gpu.py --fp8
# isoaudit is installed as a wheel and everything runs from a copy of tests/ and bench/ outside the
# checkout: run from the checkout's root, its kernels/ folder would stand for Hugging Face's `kernels`
# package, which transformers imports when it finds one on sys.path.
set -e
ROOT=$(pwd)
SITE=/tmp/isoaudit-site
if [ ! -d $SITE/isoaudit ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE .whl/*.whl
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target $SITE . >/dev/null
fi
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1
RUN=/tmp/isoaudit-run
rm -rf $RUN && mkdir -p $RUN && cp -r "$ROOT/tests" "$ROOT/bench" "$ROOT/pyproject.toml" $RUN/
cd $RUN
tool=$1; shift
if [ "$tool" = pytest ]; then exec python3 -m pytest -p no:cacheprovider -q "$@"; fi
exec python3 "$@"
