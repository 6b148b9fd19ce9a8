#!/usr/bin/env bash
# Installs what crossbar needs on Debian 12 (idempotent), then configures and builds.
#   scripts/setup.sh [build-dir]      (default: build)
# Environment: CROSSBAR_CMAKE_ARGS adds CMake options; CI=true turns warnings into errors;
#   CROSSBAR_UCX=system (default: Debian's libucx-dev, UCX 1.13) or pypi (UCX 1.22 from the
#   libucx-cu13 wheel, pip-installed; CROSSBAR_UCX_WHEEL names another requirement).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}

APT_PACKAGES=(build-essential cmake ninja-build pkg-config ccache git
  libfmt-dev libhwloc-dev libucx-dev ucx-utils libgtest-dev libgmock-dev libbenchmark-dev
  libopenmpi-dev openmpi-bin iproute2 python3 python3-pip python3-venv)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Python packages used by the test suite and the plots (torch joins when the backend lands).
PY_PACKAGES=(pytest matplotlib numpy)
if [[ -f torch_backend/CMakeLists.txt ]]; then PY_PACKAGES+=(torch); fi
need_py=()
for p in "${PY_PACKAGES[@]}"; do python3 -c "import $p" 2>/dev/null || need_py+=("$p"); done
if ((${#need_py[@]})); then
  echo "setup: pip installing ${need_py[*]}"
  # A Debian-managed python3 refuses plain pip installs (PEP 668); say we mean it.
  python3 -m pip install -q --disable-pip-version-check "${need_py[@]}" ||
    python3 -m pip install -q --disable-pip-version-check --break-system-packages "${need_py[@]}"
fi

# UCX to build against. pypi: the wheel's libucx/ (headers, libraries, a relocatable CMake
# package) becomes CROSSBAR_UCX_ROOT; binaries find its libraries through their RPATH.
# system clears CROSSBAR_UCX_ROOT, so a build directory can be switched back.
UCX_CMAKE_ARGS=()
case "${CROSSBAR_UCX:-system}" in
  system) UCX_CMAKE_ARGS+=(-DCROSSBAR_UCX_ROOT=) ;;
  pypi)
    UCX_WHEEL=${CROSSBAR_UCX_WHEEL:-libucx-cu13>=1.22,<1.23}
    echo "setup: pip installing $UCX_WHEEL (CROSSBAR_UCX=pypi)"
    python3 -m pip install -q --disable-pip-version-check "$UCX_WHEEL" ||
      python3 -m pip install -q --disable-pip-version-check --break-system-packages "$UCX_WHEEL"
    UCX_ROOT=$(python3 -c 'import libucx, os; print(os.path.dirname(libucx.__file__))')
    UCX_CMAKE_ARGS+=(-DCROSSBAR_UCX_ROOT="$UCX_ROOT")
    ;;
  *) echo "setup: CROSSBAR_UCX=${CROSSBAR_UCX} is not 'system' or 'pypi'" >&2; exit 2 ;;
esac

CMAKE_ARGS=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${UCX_CMAKE_ARGS[@]}")
if [[ "${CI:-}" == "true" ]]; then CMAKE_ARGS+=(-DCROSSBAR_WERROR=ON); fi
# shellcheck disable=SC2206
CMAKE_ARGS+=(${CROSSBAR_CMAKE_ARGS:-})
cmake -S . -B "$BUILD_DIR" "${CMAKE_ARGS[@]}" >/dev/null
echo "setup: building in $BUILD_DIR ($(nproc) cores)"
cmake --build "$BUILD_DIR" -j "$(nproc)"
