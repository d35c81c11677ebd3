// Example C++ stages, built as libstagelink_example_stages.so (see CMakeLists.txt) and used by
// examples/cpp_pipeline.yaml and the tests:
//   scale_stage:   {"x": float32 tensor, "factor": number} -> {"x": x * factor, "by": "c++"}
//   chunker_stage: {"x": tensor, "chunks": n} -> streams n chunks {"i": i, "x": x}, returns {"n": n}
//   sum_stage:     fed by a stream of {"i": i, "x": float32 tensor} -> streams {"i": i, "sum": sum of x}
//                  per chunk, returns {"n": chunks read, "sum": sum over all} (checks i counts up)
#include <cstring>
#include <vector>

#include "stagelink/stage.hpp"

using namespace stagelink;

namespace {

const Value* field(const Value& tree, std::string_view key) { return tree.find(key); }

Result<const Tensor*> tensor_field(const Payload& p, std::string_view key) {
  const Value* v = field(p.tree, key);
  if (!v || !v->is<TensorRef>() || v->as<TensorRef>().index >= p.tensors.size())
    return make_error(Errc::invalid_argument, "input has no tensor '" + std::string(key) + "'");
  return &p.tensors[v->as<TensorRef>().index];
}

Result<Payload> scale(const Payload& in, StageContext&) {
  SL_ASSIGN(const Tensor* x, tensor_field(in, "x"));
  if (x->dtype != DType::f32) return make_error(Errc::invalid_argument, "scale: x must be float32");
  double factor = 1;
  if (const Value* f = field(in.tree, "factor")) {
    if (f->is<double>()) factor = f->as<double>();
    else if (int64_t i; f->get_i64(i)) factor = double(i);
  }
  const size_t n = x->nbytes() / 4;
  auto out = std::make_shared<std::vector<float>>(n);
  const float* src = reinterpret_cast<const float*>(x->data.data());
  for (size_t i = 0; i < n; ++i) (*out)[i] = src[i] * float(factor);
  Payload p;
  Tensor t = Tensor::view_of(std::span<const std::byte>(reinterpret_cast<const std::byte*>(out->data()), n * 4),
                             DType::f32, x->shape);
  t.keepalive = out;
  p.tensors.push_back(std::move(t));
  Value::Map m;
  m.emplace_back("x", TensorRef{0});
  m.emplace_back("by", "c++");
  p.tree = Value(std::move(m));
  return p;
}

Result<Payload> chunker(const Payload& in, StageContext& ctx) {
  SL_ASSIGN(const Tensor* x, tensor_field(in, "x"));
  int64_t n = 4;
  if (const Value* c = field(in.tree, "chunks")) c->get_i64(n);
  for (int64_t i = 0; i < n; ++i) {
    Payload chunk;
    chunk.tensors.push_back(*x);
    Value::Map m;
    m.emplace_back("i", i);
    m.emplace_back("x", TensorRef{0});
    chunk.tree = Value(std::move(m));
    SL_TRY(ctx.stream(chunk));
  }
  Payload out;
  Value::Map m;
  m.emplace_back("n", n);
  out.tree = Value(std::move(m));
  return out;
}

Result<Payload> sum(const Payload&, StageContext& ctx) {
  int64_t n = 0;
  double total = 0;
  while (true) {
    SL_ASSIGN(std::optional<Payload> chunk, ctx.next_chunk());
    if (!chunk) break;  // every source has ended
    int64_t i = -1;
    if (const Value* v = field(chunk->tree, "i"); !v || !v->get_i64(i) || i != n)
      return make_error(Errc::invalid_argument, "sum: chunk " + std::to_string(n) + " carries i=" + std::to_string(i));
    SL_ASSIGN(const Tensor* x, tensor_field(*chunk, "x"));
    if (x->dtype != DType::f32) return make_error(Errc::invalid_argument, "sum: x must be float32");
    const float* v = reinterpret_cast<const float*>(x->data.data());
    double s = 0;
    for (size_t k = 0; k < x->nbytes() / 4; ++k) s += v[k];
    total += s;
    Payload out;
    Value::Map m;
    m.emplace_back("i", i);
    m.emplace_back("sum", s);
    out.tree = Value(std::move(m));
    SL_TRY(ctx.stream(out));
    ++n;
  }
  Payload out;
  Value::Map m;
  m.emplace_back("n", n);
  m.emplace_back("sum", total);
  out.tree = Value(std::move(m));
  return out;
}

Result<Payload> fail(const Payload&, StageContext& ctx) {
  return make_error(Errc::invalid_argument, "fail_stage refuses request " + std::string(ctx.request_id));
}

}  // namespace

STAGELINK_STAGE(scale_stage, scale)
STAGELINK_STAGE(chunker_stage, chunker)
STAGELINK_STAGE(sum_stage, sum)
STAGELINK_STAGE(fail_stage, fail)
