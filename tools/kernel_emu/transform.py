"""Turns csrc/layer_norm.cu into host C++ for the CPU emulator (emu.h): kernels run with one
std::thread per CUDA thread; launches, dynamic shared memory and cp.async are redirected."""
import re, sys
src = open(sys.argv[1]).read()
# dynamic shared memory
src, n = re.subn(r'extern __shared__ (\w+) (\w+)\[\];', r'\1* \2 = reinterpret_cast<\1*>(emu::dyn_smem());', src)
assert n == 2, n
# launches
src, n = re.subn(r'([\w:]+(?:<[^;<>]*>)?)<<<(.*?)>>>\((.*?)\);', r'emu::launch(\1, \2, \3);', src, flags=re.S)
assert n >= 6, n
# cp.async helpers -> emulated asynchronous copies
def body(name, new):
    global src
    m = re.search(r'(__device__ __forceinline__ void ' + name + r'\([^)]*\) \{\n)(.*?)(\n\}\n)', src, flags=re.S)
    assert m, name
    src = src[:m.start(2)] + new + src[m.end(2):]
body('cp_async16', '  emu::cp_async16(dst_smem, src_gmem);')
body('cp_async_commit', '  emu::cp_async_commit();')
body('cp_async_wait', '  emu::cp_async_wait(kPending);')
src = src.replace('asm volatile("" : "+h"(u));', '')
open(sys.argv[2], 'w').write(src)
