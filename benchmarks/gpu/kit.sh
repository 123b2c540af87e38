#!/usr/bin/env bash
# The device kit: the Python 3.12 manylinux wheels that benchmarks/gpu/check.py needs on the lent GPU machine
# (torch 2.11 + CUDA 13, transformers 5.17, pyarrow, numpy, safetensors, tokenizers, peft, accelerate, httpx,
# anyio, h11, click, rich, requests, fsspec, pyparsing, pyyaml are there already; no network there), downloaded
# here into .kit/ (ignored by git; carried by the `device` tool's `carry: [".kit"]`), at most 40 MiB.
#
# Why each is needed (the import chain of factory.core.loop / sft / evaluate / weights / trainer):
#   factory.config           pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions (>= 4.16)
#   weights codec, pyiceberg zstandard
#   envs/service.py          fastapi, starlette, opentelemetry-api (fastapi's), uvicorn, openai, jiter, sniffio,
#                            httpx2, httpcore2, truststore (openai's HTTP client)
#   data/sources, lake       pyiceberg, mmh3, pyroaring, strictyaml, cachetools, tenacity, sqlalchemy
#   trainer/megatron.py      megatron-core
# Left out: duckdb (25 MB: past the budget; only the lake's SQL queries use it, so check.py stands in for it with
# benchmarks/gpu/lakeless.py), mlflow and dagster (check.py needs no tracking or orchestration).
#
# Usage: benchmarks/gpu/kit.sh [PYTHON]   (PYTHON: an interpreter with pip; default python3)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-python3}
KIT=.kit
LIMIT=$((40 * 1024 * 1024))
WHEELS=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  zstandard==0.25.0 tenacity==9.2.1
  fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 uvicorn==0.54.0
  openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
  pyiceberg==0.12.0 mmh3==5.3.1 pyroaring==1.2.0 strictyaml==1.7.3 cachetools==7.3.3 sqlalchemy==2.1.9
  megatron-core==0.16.1
)
rm -rf "$KIT" && mkdir -p "$KIT"
# The device machine's platform (README of the device tool): CPython 3.12 on x86-64 manylinux; pip matches
# each manylinux_2_N tag exactly, hence the list.
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 -d "$KIT" "${WHEELS[@]}" 2> >(grep -v "^WARNING: Location" >&2)
n=$(ls "$KIT"/*.whl | wc -l)
bytes=$(cat "$KIT"/*.whl | wc -c)
if [ "$n" -ne "${#WHEELS[@]}" ]; then
  echo "kit.sh: expected ${#WHEELS[@]} wheels, got $n" >&2
  exit 1
fi
printf 'kit: %d wheels, %d bytes (%.1f MiB) in %s\n' "$n" "$bytes" "$(echo "$bytes / 1048576" | bc -l)" "$KIT"
if [ "$bytes" -gt "$LIMIT" ]; then
  echo "kit.sh: over the 40 MiB budget" >&2
  exit 1
fi
