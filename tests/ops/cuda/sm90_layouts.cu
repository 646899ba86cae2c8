// Host checks of the Hopper kernels' register and shared-memory layout assumptions: CuTe's layout
// algebra evaluated on the CPU for every compiled tile (tests/ops/cuda/test_cuda_sm90_layouts.py
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

// Thread coordinates (a partitioned identity tensor) as a list.
using Coords = std::vector<std::pair<int, int>>;
template <class Tensor>
void append(Coords& coords, const Tensor& c) {
  for (int i = 0; i < size(c); ++i) {
    coords.emplace_back(get<0>(c(i)), get<1>(c(i)));
  }
}

// Every (row, column) of an M x N tile is held by exactly one value of one of the 256 consumer
// threads (`tile(t)`: thread t's coordinates): P^T and dS^T written to shared memory, dK and dV
// stored, dQ added, each once per block. Returns the first problem ("" if none).
template <int M, int N, class Tile>
std::string covers_once(Tile tile) {
  std::vector<int> seen(M * N, 0);
  for (int t = 0; t < 256; ++t) {
    for (const auto& [row, col] : tile(t)) {
      if (row < 0 || row >= M || col < 0 || col >= N) {
        return "thread " + std::to_string(t) + " holds " + str(cute::make_tuple(row, col)) + ", outside the tile";
      }
      seen[row * N + col] += 1;
    }
  }
  for (int i = 0; i < M * N; ++i) {
    if (seen[i] != 1) {
      return "(" + std::to_string(i / N) + ", " + std::to_string(i % N) + ") held " + std::to_string(seen[i]) + " times";
    }
  }
  return "";
}

// A wgmma descriptor starts where its operand's slice starts, with a zero base offset (CuTe's
// make_gmma_desc): each M or N slice start (and an MN-major operand's K step) must sit on a whole
// swizzle atom (`atom` elements: 1024, 512 or 256 bytes of 16-bit values). `offsets`: the slice
// starts' element offsets before the swizzle (a slice's pointer moves by those; the swizzle
// applies to the addresses), i.e. evaluated on layout_b() of the swizzled layouts.
std::string atom_aligned(const std::vector<int>& offsets, int atom) {
  for (int offset : offsets) {
    if (offset % atom != 0) {
      return "a slice starts at element " + std::to_string(offset) + ", inside a " + std::to_string(atom) +
          "-element swizzle atom";
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
    // P^T and dS^T still go through probabilities_as_operand, which converts the accumulators'
    // storage whole into an array of acc_as_operand_a's cosize: it must be as large.
    auto acc = partition_fragment_C(typename T::TiledMmaSdP{}, Shape<Int<kN>, Int<kM>>{}).layout();
    if (cosize(acc_as_operand_a(acc)) != size(acc)) {
      record(d + " P^T, dS^T in 16 bits", "acc_as_operand_a holds " + std::to_string(cosize(acc_as_operand_a(acc))) +
                                             " of " + std::to_string(size(acc)) + " accumulators");
    }
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

  // Each element written or added once: P^T / dS^T into shared memory (S^T's accumulators), dK and
  // dV (swapped: dK^T, dV^T), and dQ over its column chunks (dq_chunks; one chunk unswapped).
  record(d + " S^T, dP^T each element once", covers_once<kN, kM>([](int t) {
    Coords coords;
    append(coords, typename T::TiledMmaSdP{}.get_thread_slice(t).partition_C(identity<kN, kM>()));
    return coords;
  }));
  constexpr int kDkvM = T::kSwapdKV ? D : kN, kDkvN = T::kSwapdKV ? kN : D;
  record(d + " dK, dV each element once", covers_once<kDkvM, kDkvN>([](int t) {
    Coords coords;
    append(coords, typename T::TiledMmadKV{}.get_thread_slice(t).partition_C(identity<kDkvM, kDkvN>()));
    return coords;
  }));
  constexpr int kChunk = D / T::kDqChunks;
  record(d + " dQ chunks each element once", covers_once<kM, D>([](int t) {
    Coords coords;
    for (int c = 0; c < T::kDqChunks; ++c) {
      append(coords, typename T::TiledMmadQ{}.get_thread_slice(t).partition_C(
                         local_tile(identity<kM, D>(), typename T::TileQDChunk{}, make_coord(_0{}, c))));
    }
    return coords;
  }));
  // The wgmma slices start on whole swizzle atoms. dQ: B = K^T's columns per warpgroup and chunk,
  // its K steps of 16 keys; A = dS's 64-query row blocks, its K steps of 16 keys.
  std::vector<int> kt, ds;
  for (int c = 0; c < T::kDqChunks; ++c) {
    for (int w = 0; w < T::kDqWarpgroupsN; ++w) {
      for (int k = 0; k < kN; k += 16) {
        kt.push_back(typename T::SmemLayoutK{}.layout_b()(k, c * kChunk + w * T::kDqWidth));
      }
    }
  }
  for (int b = 0; b < T::kDsBuffers; ++b) {
    for (int m = 0; m < kM; m += 64) {
      for (int k = 0; k < kN; k += 16) {
        ds.push_back(typename T::SmemLayoutdS{}.layout_b()(m, k, b));
      }
    }
  }
  record(d + " dQ's K^T slices", atom_aligned(kt, cosize(typename T::SmemAtomK{})));
  record(d + " dQ's dS slices", atom_aligned(ds, cosize(GMMA::Layout_MN_SW128_Atom<cutlass::half_t>{})));
  // Q^T and dO^T (MN-major: dK's and dV's B unswapped, dK^T's and dV^T's A swapped): 64-dim M
  // slices and 16-query K steps of every stage. Swapped also S^T's B (Q, dO) per warpgroup's
  // queries and dK^T's, dV^T's B (dS^T, P^T, K-major) per warpgroup's keys.
  std::vector<int> qt, q, dst;
  for (int s = 0; s < T::kStages; ++s) {
    for (int m = 0; m < D; m += 64) {
      for (int k = 0; k < kM; k += 16) {
        qt.push_back(typename T::SmemLayoutQt{}.layout_b()(m, k, s));
      }
    }
    for (int w = 0; w < 2 && T::kSwapdKV; ++w) {
      q.push_back(typename T::SmemLayoutQ{}.layout_b()(w * kM / 2, 0, s));
    }
  }
  for (int b = 0; b < T::kDsBuffers && T::kSwapdKV; ++b) {
    for (int w = 0; w < 2; ++w) {
      dst.push_back(typename T::SmemLayoutdSt{}.layout_b()(w * kN / 2, 0, b));
    }
  }
  const int atom = cosize(typename T::SmemAtom{});
  record(d + " Q^T, dO^T slices", atom_aligned(qt, atom));
  record(d + " S^T's Q, dO slices", atom_aligned(q, atom));
  record(d + " dK^T's, dV^T's dS^T, P^T slices", atom_aligned(dst, cosize(GMMA::Layout_K_SW128_Atom<cutlass::half_t>{})));
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
  // d256's dQ with every chunk taken as the first (each column of the first half added twice);
  // d96's dQ B slices in V's layout (64-byte atoms of 32 columns: the second warpgroup's 48
  // columns start inside one), the layout K had before it took its own 32-byte atom.
  using B256 = BwdTraits<cutlass::half_t, 256>;
  const auto first_chunk_twice = [](int t) {
    Coords coords;
    for (int c = 0; c < B256::kDqChunks; ++c) {
      append(coords, typename B256::TiledMmadQ{}.get_thread_slice(t).partition_C(
                         local_tile(identity<64, 256>(), typename B256::TileQDChunk{}, make_coord(_0{}, 0))));
    }
    return coords;
  };
  using B96 = BwdTraits<cutlass::half_t, 96>;
  const std::vector<int> v_slices = {typename B96::SmemLayoutV{}.layout_b()(0, 0), typename B96::SmemLayoutV{}.layout_b()(0, B96::kDqWidth)};
  // d256's S^T accumulators over two query blocks at once (two wgmma N steps): acc_as_operand_a
  // keeps one, so its array is half the accumulators.
  using SdP = typename B256::TiledMmaSdP;
  auto two_n = partition_fragment_C(SdP{}, Shape<_64, _128>{}).layout();
  const bool half_caught = cosize(acc_as_operand_a(two_n)) != size(two_n);
  return {!operand_a_from_acc<typename T::TiledMmaQK, typename T::TiledMmaPV, 128, 128>(swapped_a).empty(),
          !rowcol_view<typename T::TiledMmaQK, 128, 128>(true, swapped_rowcol).empty(),
          !covers_once<64, 256>(first_chunk_twice).empty(),
          !atom_aligned(v_slices, cosize(typename B96::SmemAtom{})).empty(), half_caught};
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
