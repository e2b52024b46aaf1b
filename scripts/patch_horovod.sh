#!/usr/bin/env bash
# Patch an unpacked Horovod 0.28.1 sdist (argument: its directory) for torch >= 2.1.
# Used by scripts/setup.sh and benchmarks/gpu_check.sh, so both build the same Horovod.
set -euo pipefail
SRC="${1:?usage: patch_horovod.sh HOROVOD_SRC_DIR}"
# PyTorch >= 2.1 headers require C++17; Horovod 0.28.1 pins C++14 in two places.
sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/horovod/torch/CMakeLists.txt"
# Horovod 0.28.1 bug: the Gloo contexts of process sets (the global process set carries
# every collective) build their TCP device from the new context's own, empty interface
# name instead of the global context's, so HOROVOD_GLOO_IFACE / horovodrun
# --network-interface are ignored for all data (found on the 2-node cluster: gradients
# went over eth0 with --iface eth1). Use the global context's interface.
GLOO_CTX="$SRC/horovod/common/gloo/gloo_context.cc"
if ! grep -q 'gloo_iface_ = global_context.gloo_iface_;' "$GLOO_CTX"; then
  sed -i '/^void GlooContext::InitializeForProcessSet/,/CreateDevice/ s/device_attr.iface = gloo_iface_;/gloo_iface_ = global_context.gloo_iface_;\n  device_attr.iface = gloo_iface_;/' "$GLOO_CTX"
fi
grep -q 'gloo_iface_ = global_context.gloo_iface_;' "$GLOO_CTX"
