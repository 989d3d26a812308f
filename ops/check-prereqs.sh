#!/bin/sh
# What `make venv` (and `pip install .`) needs, checked before a five-minute build can fail halfway:
# Python >= 3.11 with venv, a C and a C++ compiler, cmake and ninja (ggml-python is built from source),
# and an x86-64 CPU with AVX2, FMA, F16C and BMI2 (the portable x86-64-v3 ggml build; GGML_NATIVE=1
# builds for this CPU instead, whatever it has). Each missing one is named with the Debian/Ubuntu
# package that provides it; exit status 1 if any is missing.
#
#   ops/check-prereqs.sh [PYTHON]     (default: $PY, else python3; CPUINFO=/proc/cpuinfo)
set -u
PY="${1:-${PY:-python3}}"
CPUINFO="${CPUINFO:-/proc/cpuinfo}"
GGML_NATIVE="${GGML_NATIVE:-0}"
packages=""
problems=0

missing() {  # what, Debian package
    echo "  missing: $1 (Debian/Ubuntu package: $2)"
    problems=$((problems + 1))
    case " $packages " in *" $2 "*) ;; *) packages="$packages $2" ;; esac
}

echo "==> checking prerequisites"
if ! command -v "$PY" >/dev/null 2>&1; then
    missing "$PY (Python >= 3.11)" python3
else
    version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo "?")
    if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
        missing "Python >= 3.11 ($PY is $version; give another with PY=python3.11)" python3
    elif ! "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1; then
        missing "the venv module of $PY $version" python3-venv
    else
        echo "  ok: $PY $version"
    fi
fi
for tool in cc:build-essential c++:build-essential cmake:cmake ninja:ninja-build; do
    name=${tool%%:*}
    if command -v "$name" >/dev/null 2>&1; then
        echo "  ok: $name"
    else
        missing "$name" "${tool#*:}"
    fi
done
if [ "$GGML_NATIVE" = 1 ]; then
    echo "  ok: GGML_NATIVE=1 builds ggml for this CPU (no x86-64-v3 check)"
else
    arch=$(uname -m)
    flags=$(grep -m1 '^flags' "$CPUINFO" 2>/dev/null | cut -d: -f2)
    lacks=""
    for f in avx2 fma f16c bmi2; do
        case " $flags " in *" $f "*) ;; *) lacks="$lacks $f" ;; esac
    done
    if [ "$arch" != x86_64 ]; then
        echo "  missing: an x86-64 CPU (this is $arch): the ggml kernels are built for x86-64-v3; try GGML_NATIVE=1"
        problems=$((problems + 1))
    elif [ -n "$lacks" ]; then
        echo "  missing: CPU features$lacks (from $CPUINFO): the portable ggml build needs x86-64-v3" \
             "(AVX2, FMA, F16C, BMI2); GGML_NATIVE=1 builds for this CPU instead"
        problems=$((problems + 1))
    else
        echo "  ok: x86-64 CPU with AVX2, FMA, F16C, BMI2"
    fi
fi
if [ "$problems" -gt 0 ]; then
    if [ -n "$packages" ]; then
        echo "==> $problems missing; on Debian/Ubuntu: sudo apt-get install$packages"
    else
        echo "==> $problems missing"
    fi
    exit 1
fi
echo "==> prerequisites ok"
