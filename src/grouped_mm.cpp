// The grouped matrix product of mixture-of-experts layers (grouped_mm.h):
// argument checks, the choice between torch's capturable bfloat16 kernel and
// graphed's kernels (src/device/grouped_gemm_kernels.cu), and the autograd
// function around both.

#include "graphed/grouped_mm.h"

#include "graphed/check.h"

#include "device/grouped_gemm_kernels.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdint>

namespace graphed {

// Note [A grouped GEMM every dtype can capture]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A mixture of experts multiplies each token by the weights of the experts it
// was routed to. transformers (integrations/moe.py, grouped_mm_experts_forward)
// sorts the token-expert pairs by expert, counts the rows of each expert on
// the device (histc, then an int32 cumsum: the offsets) and calls
// aten::_grouped_mm(rows[S, K], weights[E, K, N], offs[E]), so the routing
// never leaves the GPU and the layer could be captured. torch's CUDA kernel
// for it (CUTLASS, GroupedBlas.cpp) only runs for bfloat16 operands on
// compute capability 9.x and 10.x. Every other case (float32, float16,
// bfloat16 on other GPUs) takes _grouped_mm_fallback, which copies the
// offsets to the host (offs.cpu(), then .item() per group) to loop over
// at::mm: a device-to-host copy, so capture fails, and eagerly a
// synchronization per call.
//
// graphed::grouped_mm keeps torch's kernel where it is capturable and runs
// its own everywhere else. The kernels read the offsets on the device: a
// captured graph replays with whatever offsets the tensor holds at replay,
// as the routing of each step writes them. Each offset is clamped into
// [0, S] and the running maximum is taken, so no offset, however wrong, makes
// a kernel read or write out of bounds (a bad offset gives wrong rows; there
// is no device assert, which would end the CUDA context). torch's kernel is
// given offsets sanitized the same way (one warp), so it cannot fault
// either. Rows past the last offset ("sentinel" rows: transformers sends the
// pairs of experts another rank owns there) are written as zeros in every
// path; torch leaves them uninitialized, zeros are deterministic, and
// transformers masks them anyway.
//
// The kernels (grouped_gemm_kernels.cu) are a shared-memory tiled SIMT
// product: 64x64 output tiles, 256 threads with 4x4 outputs each, the
// reduction staged 16 at a time as float32. Every operand is read through its
// strides, so a weight stored [E, N, K] and passed as w.transpose(-2, -1), or
// an expanded output gradient, needs no copy. The forward's grid is the row
// tiles of all groups laid end to end (ceil(S / 64) + E + 1 blocks by
// ceil(N / 64)); warp 0 of each block finds its group and rows from the
// offsets with a warp scan, 32 groups a step, and the few blocks past the
// last tile return at once, so the cost is that of the rows that exist,
// whatever the number of experts. The weight gradient, [g] = A[rows of g]^T @
// dY[rows of g], is a block per (N tile, K tile, group) that loops over its
// group's rows; a group without rows writes zeros.
//
// Numerics. Every product is a float32 FMA into a float32 accumulator. For
// float32 operands the result equals a float32 matrix product of each group
// (torch.mm with TF32 off) up to the order of the additions; float16 and
// bfloat16 operands are widened to float32, accumulated in float32 and
// rounded once to the output dtype, as autocast's matmuls do.
//
// Cost model. The kernels use no tensor cores: a fallback that is correct and
// capturable everywhere, within a small factor of cuBLAS's SIMT speed, not a
// replacement for the bfloat16 CUTLASS kernel, which keeps the cases it
// takes. The weight gradient has no split over the rows: a group with many
// rows and a small K x N is reduced by few blocks, each walking all its rows.
// For the torch path, the sanitized offsets, the zeroing of sentinel rows and
// (weight gradient) the zeroing of empty groups are three small launches;
// the last one also covers torch kernels that leave an empty group's
// gradient unwritten (pytorch/pytorch#172439, seen on sm100).

// Note [A decode step's few rows]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A decode step routes a few tokens (batch x top-k: 2 rows at batch 1 with
// top-2) to a few experts. The tiled forward gives such a group one block per
// 64 columns, which walks all of K serially in slices of 16, each slice a
// round trip to memory: for 1 row it reads the expert's weights at the speed
// of that one chain, and on the H100 it took 38-54 us a call, 30-45% of the
// kernel time of gpt-oss's and granite-moe-hybrid's decode steps at d512.
//
// A forward of at most 32 rows therefore takes a kernel that splits the
// reduction within a block instead: a block per (16 output columns, group),
// plus one block row for the rows past the last offset (zeros); each block
// finds its group's rows from the offsets as the weight gradient does, then
// walks them 4 at a time. The weights are read along whichever of their
// dimensions is closer to contiguous: along N, 16 slices of K of 16 threads
// each, one column a thread, the 16 partial sums added in slice order
// through shared memory; along K (a transposed view), a warp per column whose
// lanes stride K, reduced by a butterfly. Each output is still written by one
// thread in a fixed order, so results are deterministic; the order of the
// additions differs from the tiled kernel's, which the float32 tolerance of
// the tests covers. The choice is made on the host from the row count (a
// shape, fixed in a graph), never from the offsets, so a captured graph keeps
// its kernel whatever the routing.

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

device::GroupedMmType element_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16:
      return device::GroupedMmType::kBFloat16;
    case at::kHalf:
      return device::GroupedMmType::kFloat16;
    default:
      return device::GroupedMmType::kFloat32;
  }
}

cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

device::GroupOffsets offsets_of(const at::Tensor& offs) {
  device::GroupOffsets offsets;
  offsets.ends = offs.data_ptr<int32_t>();
  offsets.stride = offs.stride(0);
  offsets.groups = offs.size(0);
  return offsets;
}

std::string describe(const at::Tensor& t) {
  return t.defined() ? c10::str(t.scalar_type(), " ", t.sizes(), " on ", t.device()) : "none";
}

void check_input_type(const at::Tensor& a) {
  const auto type = a.scalar_type();
  GRAPHED_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf,
                "Expected the input of grouped_mm in float32, bfloat16 or float16, got ", type,
                ". Cast it first (.float() or .to(torch.bfloat16)).");
}

void check_offsets(const at::Tensor& offs) {
  GRAPHED_CHECK(offs.dim() == 1 && offs.scalar_type() == at::kInt,
                "Expected the offsets of grouped_mm to be a 1-D int32 tensor [groups] (the ",
                "cumulative row count of every group), got ", describe(offs),
                ". Compute them with torch.cumsum(rows_per_group, 0, dtype=torch.int32).");
}

// The device checks come last, so that every other mistake is reported the
// same way on a machine without a GPU.
void check_devices(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                   const char* b_name) {
  GRAPHED_CHECK(a.is_cuda() && b.is_cuda() && offs.is_cuda(),
                "Expected CUDA tensors for grouped_mm (it exists to be captured in CUDA graphs), ",
                "got the input on ", a.device(), ", ", b_name, " on ", b.device(),
                " and the offsets on ", offs.device(),
                ". Move all three to the GPU (.cuda()); on the CPU, loop over the groups with ",
                "torch.mm.");
  GRAPHED_CHECK(a.device() == b.device() && a.device() == offs.device(),
                "Expected the tensors of grouped_mm on one device, got the input on ", a.device(),
                ", ", b_name, " on ", b.device(), " and the offsets on ", offs.device(),
                ". Move them to the same GPU.");
}

void check_grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  GRAPHED_CHECK(a.defined() && b.defined() && offs.defined(),
                "Expected three tensors for grouped_mm (the input, the weights and the offsets), ",
                "got the input ", describe(a), ", the weights ", describe(b), " and the offsets ",
                describe(offs), ".");
  GRAPHED_CHECK(a.dim() == 2, "Expected the input of grouped_mm to be 2-D [rows, in_features] ",
                "(the rows of every group, sorted by group), got ", a.dim(), "-D ", a.sizes(),
                ". Flatten the leading dimensions first (x.reshape(-1, x.size(-1))).");
  GRAPHED_CHECK(b.dim() == 3, "Expected the weights of grouped_mm to be 3-D [groups, ",
                "in_features, out_features], got ", b.dim(), "-D ", b.sizes(),
                ". Stack the experts' weights; weights stored [groups, out_features, ",
                "in_features] are passed as w.transpose(-2, -1).");
  check_input_type(a);
  GRAPHED_CHECK(b.scalar_type() == a.scalar_type(), "Expected the input and the weights of ",
                "grouped_mm in one dtype, got the input in ", a.scalar_type(),
                " and the weights in ", b.scalar_type(),
                ". Cast the input to the weights' dtype (input.to(weight.dtype)), as ",
                "transformers' grouped_mm does.");
  check_offsets(offs);
  GRAPHED_CHECK(offs.size(0) == b.size(0), "Expected one offset per group of grouped_mm: the ",
                "weights have ", b.size(0), " groups, got ", offs.size(0),
                " offsets. Pass offs[g] = the end of group g's rows for every group, also the ",
                "groups without rows.");
  GRAPHED_CHECK(a.size(1) == b.size(1), "Expected the input's in_features to match the ",
                "weights' of grouped_mm, got the input ", a.sizes(), " and the weights ", b.sizes(),
                " (in_features ", a.size(1), " and ", b.size(1),
                "). Pass weights [groups, in_features, out_features]; for weights stored ",
                "[groups, out_features, in_features] pass w.transpose(-2, -1).");
  check_devices(a, b, offs, "the weights");
}

void check_weight_grad(const at::Tensor& a, const at::Tensor& grad, const at::Tensor& offs) {
  GRAPHED_CHECK(a.defined() && grad.defined() && offs.defined(),
                "Expected three tensors for grouped_mm's weight gradient (the input, the output ",
                "gradient and the offsets), got the input ", describe(a), ", the gradient ",
                describe(grad), " and the offsets ", describe(offs), ".");
  GRAPHED_CHECK(a.dim() == 2 && grad.dim() == 2 && a.size(0) == grad.size(0),
                "Expected the input [rows, in_features] and the output gradient [rows, ",
                "out_features] of grouped_mm's weight gradient with one row count, got ",
                a.sizes(), " and ", grad.sizes(), ". Pass the forward's input and the gradient ",
                "of its output.");
  check_input_type(a);
  GRAPHED_CHECK(grad.scalar_type() == a.scalar_type(), "Expected the input and the output ",
                "gradient of grouped_mm's weight gradient in one dtype, got ", a.scalar_type(),
                " and ", grad.scalar_type(), ". Cast the gradient to the input's dtype.");
  check_offsets(offs);
  check_devices(a, grad, offs, "the output gradient");
}

// Whether torch's CUTLASS kernel takes `t` as it is: what its
// check_valid_strides_and_return_transposed accepts (16-byte aligned, one of
// the last two dimensions contiguous and the other's stride a multiple of 16
// bytes), and a 16-byte aligned group stride for 3-D operands.
bool torch_takes_layout(const at::Tensor& t) {
  const int64_t alignment = 16 / static_cast<int64_t>(t.element_size());
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) {
    return false;
  }
  const int64_t last = t.dim() - 1;
  const int64_t rows = t.size(last - 1);
  const int64_t cols = t.size(last);
  const int64_t row_stride = t.stride(last - 1);
  const int64_t col_stride = t.stride(last);
  const bool row_major = col_stride == 1 && row_stride >= std::max<int64_t>(1, cols) &&
                         row_stride % alignment == 0;
  const bool col_major = row_stride == 1 && col_stride >= std::max<int64_t>(1, rows) &&
                         col_stride % alignment == 0;
  const bool groups_aligned = t.dim() < 3 || t.stride(0) % alignment == 0;
  return (row_major || col_major) && groups_aligned;
}

// bfloat16 CUDA operands on a GPU whose major compute capability torch's
// kernel was built for (its _scaled_mm_allowed_device(sm90, sm100) gate).
bool torch_kernel_runs(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined() || !a.is_cuda() || a.device() != b.device() ||
      a.scalar_type() != at::kBFloat16 || b.scalar_type() != at::kBFloat16) {
    return false;
  }
  const int major = at::cuda::getDeviceProperties(a.device().index())->major;
  return major == 9 || major == 10;
}

// The offsets as the kernels read them (clamped, non-decreasing), for torch's kernel.
at::Tensor sanitized_offsets(const at::Tensor& offs, int64_t rows) {
  const at::Tensor out = at::empty({offs.size(0)}, offs.options().dtype(at::kInt));
  GRAPHED_CHECK_CUDA(device::launch_sanitize_group_offsets(offsets_of(offs), rows,
                                                           out.data_ptr<int32_t>(),
                                                           stream_of(offs)));
  return out;
}

at::Tensor forward_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                           GroupedMmKernels kernels) {
  const c10::cuda::CUDAGuard guard(a.device());
  const cudaStream_t stream = stream_of(a);
  if (kernels == GroupedMmKernels::kAuto && grouped_mm_uses_torch(a, b)) {
    const at::Tensor ends = sanitized_offsets(offs, a.size(0));
    at::Tensor out = at::_grouped_mm(a, b, ends);
    device::StridedMatrix rows;
    rows.type = element_type(out);
    rows.data = out.data_ptr();
    rows.rows = out.size(0);
    rows.cols = out.size(1);
    rows.stride[0] = out.stride(0);
    rows.stride[1] = out.stride(1);
    GRAPHED_CHECK_CUDA(device::launch_zero_rows_from(
        rows, ends.data_ptr<int32_t>() + (ends.size(0) - 1), stream));
    return out;
  }
  at::Tensor out = at::empty({a.size(0), b.size(2)}, a.options());
  device::GroupedMm mm;
  mm.type = element_type(a);
  mm.a = a.data_ptr();
  mm.a_stride[0] = a.stride(0);
  mm.a_stride[1] = a.stride(1);
  mm.b = b.data_ptr();
  for (int d = 0; d < 3; ++d) {
    mm.b_stride[d] = b.stride(d);
  }
  mm.out = out.data_ptr();
  mm.out_stride[0] = out.stride(0);
  mm.out_stride[1] = out.stride(1);
  mm.offsets = offsets_of(offs);
  mm.rows = a.size(0);
  mm.k = a.size(1);
  mm.n = b.size(2);
  GRAPHED_CHECK_CUDA(device::launch_grouped_mm(mm, stream));
  return out;
}

at::Tensor weight_grad_product(const at::Tensor& a, const at::Tensor& grad,
                               const at::Tensor& offs, GroupedMmKernels kernels) {
  const c10::cuda::CUDAGuard guard(a.device());
  const cudaStream_t stream = stream_of(a);
  const int64_t groups = offs.size(0);
  const at::Tensor a_t = a.t();
  if (kernels == GroupedMmKernels::kAuto && groups > 0 && a.size(0) > 0 && a.size(1) > 0 &&
      grad.size(1) > 0 && torch_kernel_runs(a, grad) && torch_takes_layout(a_t) &&
      torch_takes_layout(grad)) {
    const at::Tensor ends = sanitized_offsets(offs, a.size(0));
    at::Tensor out = at::_grouped_mm(a_t, grad, ends);
    const int64_t stride[3] = {out.stride(0), out.stride(1), out.stride(2)};
    GRAPHED_CHECK_CUDA(device::launch_zero_empty_groups(element_type(out), out.data_ptr(), stride,
                                                        out.size(1), out.size(2),
                                                        ends.data_ptr<int32_t>(), groups,
                                                        stream));
    return out;
  }
  at::Tensor out = at::empty({groups, a.size(1), grad.size(1)}, a.options());
  device::GroupedMmWeightGrad w;
  w.type = element_type(a);
  w.a = a.data_ptr();
  w.a_stride[0] = a.stride(0);
  w.a_stride[1] = a.stride(1);
  w.grad = grad.data_ptr();
  w.grad_stride[0] = grad.stride(0);
  w.grad_stride[1] = grad.stride(1);
  w.out = out.data_ptr();
  for (int d = 0; d < 3; ++d) {
    w.out_stride[d] = out.stride(d);
  }
  w.offsets = offsets_of(offs);
  w.rows = a.size(0);
  w.k = a.size(1);
  w.n = grad.size(1);
  GRAPHED_CHECK_CUDA(device::launch_grouped_mm_weight_grad(w, stream));
  return out;
}

struct GroupedMmFunction : public torch::autograd::Function<GroupedMmFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b,
                               const at::Tensor& offs, GroupedMmKernels kernels) {
    ctx->save_for_backward({a, b, offs});
    ctx->saved_data["kernels"] = static_cast<int64_t>(kernels);
    return {forward_product(a, b, offs, kernels)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& a = saved[0];
    const at::Tensor& b = saved[1];
    const at::Tensor& offs = saved[2];
    const auto kernels = static_cast<GroupedMmKernels>(ctx->saved_data["kernels"].toInt());
    const at::Tensor& grad = grad_outputs[0];
    at::Tensor grad_a;
    at::Tensor grad_b;
    if (ctx->needs_input_grad(0)) {
      // Rows past the last offset get zeros, as their outputs did not depend on them.
      grad_a = forward_product(grad, b.transpose(-2, -1), offs, kernels);
    }
    if (ctx->needs_input_grad(1)) {
      // [E, K, N], b's logical shape; autograd takes it back through a
      // transposed view of the weights itself.
      grad_b = weight_grad_product(a, grad, offs, kernels);
    }
    return {grad_a, grad_b, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool grouped_mm_uses_torch(const at::Tensor& a, const at::Tensor& b) {
  if (!torch_kernel_runs(a, b) || a.dim() != 2 || b.dim() != 3 || a.size(1) != b.size(1)) {
    return false;
  }
  if (a.numel() == 0 || b.numel() == 0) {
    return false;  // graphed's kernels handle the empty cases, with zeros
  }
  return torch_takes_layout(a) && torch_takes_layout(b);
}

at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                      GroupedMmKernels kernels) {
  check_grouped_mm(a, b, offs);
  return GroupedMmFunction::apply(a, b, offs, kernels)[0];
}

at::Tensor grouped_mm_weight_grad(const at::Tensor& a, const at::Tensor& grad,
                                  const at::Tensor& offs, GroupedMmKernels kernels) {
  check_weight_grad(a, grad, offs);
  return weight_grad_product(a, grad, offs, kernels);
}

}  // namespace graphed
