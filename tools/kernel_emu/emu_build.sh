# Builds the CPU emulation of csrc/layer_norm.cu into ./build/driver (see README.txt).
# EXTRA="-fsanitize=thread" for ThreadSanitizer.
set -e
here=$(cd "$(dirname "$0")" && pwd); repo=$(cd "$here/../.." && pwd)
mkdir -p "$here/build" && cd "$here/build"
python3 "$here/transform.py" "$repo/csrc/layer_norm.cu" emu_layer_norm.cpp
g++ -std=c++20 -O2 -g ${EXTRA:-} -I/usr/local/cuda/include -I"$repo/csrc" -I. -include "$here/emu.h" \
  "$here/driver.cpp" -o driver -lpthread
echo "built $here/build/driver"
