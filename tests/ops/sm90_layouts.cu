// Host checks of the Hopper kernels' register and shared-memory layout assumptions: CuTe's layout
// algebra evaluated on the CPU for every compiled tile (tests/ops/test_cuda_sm90_layouts.py
// compiles and runs this). Prints JSON: {"problems": [...], "controls": [...]}; problems is empty
// when every assumption holds; controls are deliberately broken mappings, each of which must be
// caught (true), so that the checks are shown able to fail.
#include <cstdio>
#include <string>
#include <vector>

// The forward's traits first: they enable CuTe's extended wgmma shapes (80- and 112-key tiles)
// before CuTe's first inclusion.
#include "kernels/cuda/hopper/flash_fwd_sm90_traits.cuh"
#include "kernels/cuda/hopper/flash_bwd_sm90_traits.cuh"
#include "kernels/cuda/hopper/flash_fwd_sm90_softmax.cuh"

using namespace cute;
using namespace attn_export::cuda::sm90;

namespace {

std::vector<std::string> problems;

template <class Coord>
std::string str(const Coord& c) {
  return "(" + std::to_string(get<0>(c)) + ", " + std::to_string(get<1>(c)) + ")";
}

template <int M, int N>
auto identity() {
  return make_identity_tensor(Shape<Int<M>, Int<N>>{});
}

// The accumulators of `Acc` (M x N), converted in place (as_a: acc_as_operand_a), are the A
// operand of the register-sourced `MmaA` (M x K, K = N): thread t's A value i must hold the
// (row, k) that the wgmma reads there. Returns the first mismatch ("" if none).
template <class Acc, class MmaA, int M, int N, class AsA>
std::string operand_a_from_acc(AsA as_a) {
  for (int t = 0; t < 256; ++t) {
    auto c = Acc{}.get_thread_slice(t).partition_C(identity<M, N>());
    auto a = MmaA{}.get_thread_slice(t).partition_A(identity<M, N>());
    auto c_as_a = make_tensor(c.data(), as_a(c.layout()));
    if (size(c_as_a) != size(a) || size<1>(c_as_a) != size<1>(a) || size<2>(c_as_a) != size<2>(a)) {
      return "the A fragment's shape is not the accumulators'";
    }
    for (int i = 0; i < size(a); ++i) {
      if (get<0>(c_as_a(i)) != get<0>(a(i)) || get<1>(c_as_a(i)) != get<1>(a(i))) {
        return "thread " + std::to_string(t) + " value " + std::to_string(i) + " holds " + str(c_as_a(i)) +
            ", the wgmma reads " + str(a(i));
      }
    }
  }
  return "";
}

// rowcol's (row, column) view of an M x N accumulator, as the kernels use it: one row per r;
// columns c, c + 1 (c even) adjacent (paired 4- and 8-byte stores and atomics); with whole_rows,
// the 4 threads of a quad hold all N columns of the same rows, once (two-shuffle row reductions).
template <class Mma, int M, int N, class RowCol>
std::string rowcol_view(bool whole_rows, RowCol view) {
  for (int t = 0; t < 256; t += 4) {
    auto first = make_tensor(Mma{}.get_thread_slice(t).partition_C(identity<M, N>()).data(),
                             view(Mma{}.get_thread_slice(t).partition_C(identity<M, N>()).layout()));
    for (int r = 0; r < size<0>(first); ++r) {
      const int row = get<0>(first(r, 0));
      std::vector<int> seen(N, 0);
      for (int q = t; q < t + 4; ++q) {
        auto c = Mma{}.get_thread_slice(q).partition_C(identity<M, N>());
        auto rc = make_tensor(c.data(), view(c.layout()));
        for (int col = 0; col < size<1>(rc); ++col) {
          if (get<0>(rc(r, col)) != row) {
            return "thread " + std::to_string(q) + " holds " + str(rc(r, col)) + " in row " + std::to_string(row);
          }
          if (col % 2 == 1 && get<1>(rc(r, col)) != get<1>(rc(r, col - 1)) + 1) {
            return "thread " + std::to_string(q) + ": " + str(rc(r, col - 1)) + ", " + str(rc(r, col)) + " not adjacent";
          }
          seen[get<1>(rc(r, col))] += 1;
        }
      }
      for (int n = 0; whole_rows && n < N; ++n) {
        if (seen[n] != 1) {
          return "row " + std::to_string(row) + " column " + std::to_string(n) + " held " + std::to_string(seen[n]) +
              " times by its quad";
        }
      }
    }
  }
  return "";
}

// A transposed view (composition with an ordered layout) addresses the same elements; S stages
// (S = 0: a layout without a stage mode).
template <class Layout, class LayoutT, int A, int B, int S>
std::string transposed_view() {
  for (int s = 0; s < (S > 0 ? S : 1); ++s) {
    for (int a = 0; a < A; ++a) {
      for (int b = 0; b < B; ++b) {
        bool same;
        if constexpr (S > 0) {
          same = LayoutT{}(b, a, s) == Layout{}(a, b, s);
        } else {
          same = LayoutT{}(b, a) == Layout{}(a, b);
        }
        if (!same) {
          return "(" + std::to_string(a) + ", " + std::to_string(b) + ", " + std::to_string(s) + ") moved";
        }
      }
    }
  }
  return "";
}

void record(const std::string& what, const std::string& problem) {
  if (!problem.empty()) {
    problems.push_back(what + ": " + problem);
  }
}

const auto kAsA = [](auto acc) { return acc_as_operand_a(acc); };
const auto kRowCol = [](auto acc) { return rowcol(acc); };

template <int D>
void forward() {
  using T = FwdTraits<cutlass::half_t, D, false>;
  constexpr int kM = T::kBlockM, kN = T::kBlockN;
  const std::string d = "forward d" + std::to_string(D);
  record(d + " P (S's accumulators) as P V's A", operand_a_from_acc<typename T::TiledMmaQK, typename T::TiledMmaPV, kM, kN>(kAsA));
  record(d + " S rows", rowcol_view<typename T::TiledMmaQK, kM, kN>(true, kRowCol));
  record(d + " O rows", rowcol_view<typename T::TiledMmaPV, kM, D>(true, kRowCol));
  record(d + " V^T", transposed_view<typename T::SmemLayoutV, typename T::SmemLayoutVt, kN, D, T::kStages>());
}

template <int D>
void backward() {
  using T = BwdTraits<cutlass::half_t, D>;
  constexpr int kM = T::kBlockM, kN = T::kBlockN;
  const std::string d = "backward d" + std::to_string(D);
  if constexpr (T::kSwapdKV) {
    // dK^T, dV^T (head dim x keys) from P and dS in shared memory: no register operand to check.
    record(d + " dK^T, dV^T rows", rowcol_view<typename T::TiledMmadKV, D, kN>(false, kRowCol));
  } else {
    record(d + " P^T, dS^T as dV's, dK's A", operand_a_from_acc<typename T::TiledMmaSdP, typename T::TiledMmadKV, kN, kM>(kAsA));
    record(d + " dK, dV rows", rowcol_view<typename T::TiledMmadKV, kN, D>(false, kRowCol));
  }
  record(d + " S^T, dP^T rows", rowcol_view<typename T::TiledMmaSdP, kN, kM>(false, kRowCol));
  record(d + " dQ rows", rowcol_view<typename T::TiledMmadQ, kM, D / T::kDqChunks>(false, kRowCol));
  record(d + " Q^T, dO^T", transposed_view<typename T::SmemLayoutQ, typename T::SmemLayoutQt, kM, D, T::kStages>());
  record(d + " K^T", transposed_view<typename T::SmemLayoutK, typename T::SmemLayoutKt, kN, D, 0>());
  record(d + " dS^T", transposed_view<typename T::SmemLayoutdS, typename T::SmemLayoutdSt, kM, kN, T::kDsBuffers>());
}

// Broken mappings the checks must catch: the two rows of an A value pair swapped with its two
// columns; rows and columns of an accumulator swapped within each 8x8 tile.
std::vector<bool> controls() {
  using T = FwdTraits<cutlass::half_t, 128, false>;
  const auto swapped_a = [](auto acc) {
    auto l = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});
    return make_layout(make_layout(get<1>(l), get<0>(l), get<2, 0>(l)), get<1>(acc), get<2, 1>(l));
  };
  const auto swapped_rowcol = [](auto acc) {
    return make_layout(make_layout(get<0, 0>(acc), get<1>(acc)), make_layout(get<0, 1>(acc), get<0, 2>(acc), get<2>(acc)));
  };
  return {!operand_a_from_acc<typename T::TiledMmaQK, typename T::TiledMmaPV, 128, 128>(swapped_a).empty(),
          !rowcol_view<typename T::TiledMmaQK, 128, 128>(true, swapped_rowcol).empty()};
}

}  // namespace

int main() {
  forward<32>();
  forward<64>();
  forward<96>();
  forward<128>();
  forward<192>();
  forward<256>();
  backward<32>();
  backward<64>();
  backward<96>();
  backward<128>();
  backward<192>();
  backward<256>();
  const std::vector<bool> caught = controls();
  std::printf("{\"problems\": [");
  for (size_t i = 0; i < problems.size(); ++i) {
    std::printf("%s\"%s\"", i ? ", " : "", problems[i].c_str());
  }
  std::printf("], \"controls\": [");
  for (size_t i = 0; i < caught.size(); ++i) {
    std::printf("%s%s", i ? ", " : "", caught[i] ? "true" : "false");
  }
  std::printf("]}\n");
}
