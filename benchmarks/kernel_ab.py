"""Two builds of the AVX2 integer-dot kernel, timed in one process by turns: an A/B that a
noisy shared host cannot fake.

Usage: python benchmarks/kernel_ab.py A B [--cases N,K,M,BITS,PLANES ...] [--reps 40]
       [--threads 1] [--out FILE]
A and B are git revisions (`worktree` for the files as they are now). Each one's
src/clover/kernels/qgemm_dots_avx2.cpp and qgemm.h are compiled as the extension builds them
(g++ -O3), B under renamed symbols, into one small program that runs `qgemm_tiles_dots_avx2`
on the same random weights and x: A then B, `reps` times, 10 calls each, the fastest kept.
Why: on the 2-core hosts here the same pass read 1.0 and 1.5 AR steps in runs 20 minutes
apart; only alternating the two builds inside one process showed a 10% change for what it was.
Each case also checks that both builds give the same outputs to the bit (`same`). Both
revisions must share qgemm.h (one QGemm is handed to both builds) and have `x_planes` in it
(92ab6a9 on); otherwise the script says so and stops.
A case: output rows N (a multiple of 16), input width K (of 32), rows of x M, weight bits
(4, 5 or 8), x planes (1: x on 8 bits; 2: 15 bits; 8-bit weights always 2). The matrix is
random; scales are float16. Writes benchmarks/results/kernel-ab-<A>-<B>.json.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from clover.bench.common import machine, now, write_results

ROOT = Path(__file__).resolve().parents[1]
KERNELS = "src/clover/kernels"
FILES = ("qgemm_dots_avx2.cpp", "qgemm.h")
CASES = ["4864,896,1,4,1", "4864,896,4,4,1", "4864,896,16,4,1", "4864,896,4,5,1",
         "4864,896,16,5,1", "4864,896,4,4,2", "4864,896,4,8,2"]  # fmt: skip

HARNESS = r"""
#include "qgemm.h"
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
namespace clover {
void qgemm_tiles_scalar(const QGemm&, int64_t, int64_t) {}  // never called on x86-64
void qgemm_tiles_dots_avx2_b(const QGemm& a, int64_t t0, int64_t t1);
}
using namespace clover;
int main(int argc, char** argv) {
  const int64_t N = atol(argv[1]), K = atol(argv[2]), M = atol(argv[3]);
  const int bits = atoi(argv[4]), planes = atoi(argv[5]), reps = atoi(argv[6]);
  const int threads = atoi(argv[7]);
  const int group = 32, G = K / group;
  const int64_t tile = bits == 4 ? 256 : bits == 5 ? 320 : 16 * group;
  srand(1);
  std::vector<uint8_t> q(N / 16 * G * tile);
  for (auto& v : q) v = rand();
  std::vector<uint16_t> sc(N / 16 * G * 32);
  for (auto& v : sc) v = 0x2000 + rand() % 256;  // float16 scales and lows near 0.008
  std::vector<int8_t> xq(M * K * 2);
  for (auto& v : xq) v = rand() % 255 - 127;
  std::vector<float> xd(M * G, 0.01f), xsum(M * G, 1.f), out_a(M * N), out_b(M * N);
  std::vector<int32_t> xqs(M * G, 5);
  QGemm a;
  a.bits = bits, a.group = group, a.has_low = true, a.f16_scales = true;
  a.M = M, a.N = N, a.K = K, a.q = q.data(), a.scales = sc.data();
  a.xq = xq.data(), a.xd = xd.data(), a.xqs = xqs.data(), a.xsum = xsum.data();
  a.x_planes = bits == 8 ? 2 : planes;
  QGemm b = a;
  a.out_f32 = out_a.data(), b.out_f32 = out_b.data();
  const int64_t T = N / 16;
  auto run = [&](int v) {
#pragma omp parallel num_threads(threads)
    {
      const int th = omp_get_thread_num(), n = omp_get_num_threads();
      const int64_t t0 = T * th / n, t1 = T * (th + 1) / n;
      if (v) qgemm_tiles_dots_avx2_b(b, t0, t1); else qgemm_tiles_dots_avx2(a, t0, t1);
    }
  };
  for (int v = 0; v < 2; ++v) for (int i = 0; i < 3; ++i) run(v);
  double best[2] = {1e30, 1e30};
  for (int r = 0; r < reps; ++r)
    for (int v = 0; v < 2; ++v) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 10; ++i) run(v);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best[v] = std::min(best[v], s / 10);
    }
  printf("%.6f %.6f %d\n", best[0] * 1e3, best[1] * 1e3, out_a == out_b ? 1 : 0);
}
"""


def parse_case(text: str) -> tuple[int, int, int, int, int]:
    """'N,K,M,BITS,PLANES' -> ints, checked as the kernel needs them."""
    try:
        n, k, m, bits, planes = (int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"case {text!r}: five integers N,K,M,BITS,PLANES") from None
    if (
        n <= 0
        or n % 16
        or k <= 0
        or k % 32
        or m <= 0
        or bits not in (4, 5, 8)
        or planes not in (1, 2)
    ):
        raise SystemExit(
            f"case {text!r}: N a multiple of 16, K of 32, M >= 1, BITS 4/5/8, PLANES 1/2"
        )
    return n, k, m, bits, planes


def sources(rev: str, into: Path) -> None:
    """The kernel's files at git revision `rev` (or as they are now: `worktree`) into `into`."""
    into.mkdir(parents=True)
    for name in FILES:
        if rev == "worktree":
            shutil.copy(ROOT / KERNELS / name, into / name)
            continue
        got = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{KERNELS}/{name}"],
                             capture_output=True, text=True)  # fmt: skip
        if got.returncode:
            raise SystemExit(f"{rev}: no {KERNELS}/{name} there ({got.stderr.strip()})")
        (into / name).write_text(got.stdout)


def build(a: str, b: str, work: Path) -> Path:
    compiler = shutil.which("g++")
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        raise SystemExit("needs g++ on an x86-64 machine (the kernel is AVX2)")
    flags = ["-O3", "-std=c++17", "-fopenmp"]  # standalone sources, no PyTorch headers
    objects = []
    rename = ["-Dqgemm_tiles_dots_avx2=qgemm_tiles_dots_avx2_b",
              "-Dquantize_rows_avx2=quantize_rows_avx2_b"]  # fmt: skip
    for tag, rev in (("a", a), ("b", b)):
        sources(rev, work / tag)
    if (work / "a" / FILES[1]).read_text() != (work / "b" / FILES[1]).read_text():
        raise SystemExit(
            f"{FILES[1]} differs between {a} and {b}: the program hands one QGemm to both "
            "builds, so they must share its layout"
        )
    for tag, extra in (("a", []), ("b", rename)):
        src = work / tag
        obj = work / f"{tag}.o"
        subprocess.run([compiler, *flags, *extra, "-c", str(src / FILES[0]), "-o", str(obj)],
                       check=True)  # fmt: skip
        objects.append(str(obj))
    (work / "main.cpp").write_text(HARNESS)
    exe = work / "ab"
    subprocess.run([compiler, *flags, f"-I{work / 'a'}", str(work / "main.cpp"), *objects,
                    "-o", str(exe)], check=True)  # fmt: skip
    return exe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--cases", nargs="+", default=CASES)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out")
    args = p.parse_args(argv)
    cases = [parse_case(c) for c in args.cases]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(args.a, args.b, Path(tmp))
        for n, k, m, bits, planes in cases:
            got = subprocess.run([str(exe), str(n), str(k), str(m), str(bits), str(planes),
                                  str(args.reps), str(args.threads)],
                                 capture_output=True, text=True, check=True)  # fmt: skip
            a_ms, b_ms, same = got.stdout.split()
            a_ms, b_ms = float(a_ms), float(b_ms)
            row = {"N": n, "K": k, "M": m, "bits": bits, "x_planes": planes if bits != 8 else 2,
                   "a_ms": a_ms, "b_ms": b_ms, "b_over_a": round(b_ms / a_ms, 3),
                   "same": same == "1"}  # fmt: skip
            rows.append(row)
            print(f"N {n:6d} K {k:5d} M {m:3d} int{bits} x planes {row['x_planes']}: "
                  f"A {row['a_ms']:.3f} ms, B {row['b_ms']:.3f} ms, B/A {row['b_over_a']:.3f}"
                  f"{'' if row['same'] else '  OUTPUTS DIFFER'}", flush=True)  # fmt: skip
    label = lambda r: r.replace("/", "_")  # noqa: E731
    out = (
        Path(args.out)
        if args.out
        else (ROOT / "benchmarks" / "results" / f"kernel-ab-{label(args.a)}-{label(args.b)}.json")
    )
    command = shlex.join(["python", "benchmarks/kernel_ab.py", *(argv or sys.argv[1:])])
    report = {"benchmark": "benchmarks/kernel_ab.py", "date": now(), "command": command,
              "machine": machine(), "a": args.a, "b": args.b, "reps": args.reps,
              "threads": args.threads, "cases": rows}  # fmt: skip
    print(f"wrote {write_results(report, out)}")
    if not all(r["same"] for r in rows):
        print(
            "the builds' outputs differ: they compute different things (expected only where "
            "a change meant to alter the arithmetic)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
