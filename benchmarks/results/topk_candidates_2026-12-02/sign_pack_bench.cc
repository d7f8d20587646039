// sign_pack on 25,185,290 standard normal values (mlp4096's count), chunk 1024, one thread and two
// (a std::thread pool of 2), best of 7; compiled against either kernels/sign.h.
#include "kernels/sign.h"
#include <chrono>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>
template <class F> double best(F f) { double b = 1e9; for (int i = 0; i < 7; ++i) { auto t = std::chrono::steady_clock::now(); f(); double d = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count(); if (d < b) b = d; } return b * 1e3; }
int main(int, char** argv) {
  const int64_t n = 25185290, chunk = 1024;
  std::vector<float> x(n); std::mt19937 g(1); std::normal_distribution<float> d; for (auto& v : x) v = d(g);
  std::vector<uint32_t> words((n + 31) / 32); std::vector<float> scales((n + chunk - 1) / chunk);
  jaxcomp::Parallel one;
  jaxcomp::Parallel two; two.concurrency = 2;
  two.run = [](int64_t tasks, const jaxcomp::Task& task) {
    std::thread t([&] { for (int64_t i = 1; i < tasks; i += 2) task(i); });
    for (int64_t i = 0; i < tasks; i += 2) task(i);
    t.join();
  };
  std::printf("%s: one thread %.1f ms, two %.1f ms\n", argv[1],
              best([&] { (void)jaxcomp::sign_pack(x.data(), 1, n, chunk, words.data(), scales.data(), one); }),
              best([&] { (void)jaxcomp::sign_pack(x.data(), 1, n, chunk, words.data(), scales.data(), two); }));
}
