#include "examples/llama/chat_data.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>

#include "fsdp/formats/safetensors.h"

namespace fsdp::models {
namespace {

// The 1-D tensor `name` of `file`, of `dtype`; throws naming both otherwise.
at::Tensor read_vector(const SafetensorsFile& file, const std::string& name, at::ScalarType dtype) {
  const SafetensorsTensorInfo* info = file.find(name);
  TORCH_CHECK(info != nullptr, file.path(), ": no tensor '", name,
              "'; expected a conversation file from examples/llama/prepare_chat.py (input_ids, "
              "loss_mask, example_offsets)");
  TORCH_CHECK(info->dtype == dtype && info->shape.size() == 1, file.path(), ": '", name, "' is ",
              safetensors_dtype_name(info->dtype), " of ", info->shape.size(),
              " dimensions; expected a 1-D ", safetensors_dtype_name(dtype), " tensor");
  return file.read(name);
}

}  // namespace

ChatExamples read_chat_file(const std::string& path, int64_t vocab_size) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  const auto format = file.header().metadata.find("format");
  TORCH_CHECK(format != file.header().metadata.end() && format->second == "fsdp-chat-v1", path,
              ": __metadata__ format is '",
              format == file.header().metadata.end() ? std::string("(none)") : format->second,
              "'; expected fsdp-chat-v1, a conversation file from examples/llama/prepare_chat.py");
  const at::Tensor ids = read_vector(file, "input_ids", at::kInt);
  const at::Tensor mask = read_vector(file, "loss_mask", at::kByte);
  const at::Tensor offsets = read_vector(file, "example_offsets", at::kLong);
  const int64_t n = ids.numel();
  TORCH_CHECK(mask.numel() == n, path, ": loss_mask has ", mask.numel(), " entries and input_ids ",
              n, "; expected one mask entry per token");
  TORCH_CHECK(offsets.numel() >= 2, path, ": example_offsets has ", offsets.numel(),
              " entries; expected at least 2 (one example)");
  ChatExamples examples;
  examples.offsets.assign(offsets.data_ptr<int64_t>(),
                          offsets.data_ptr<int64_t>() + offsets.numel());
  TORCH_CHECK(examples.offsets.front() == 0 && examples.offsets.back() == n, path,
              ": example_offsets run from ", examples.offsets.front(), " to ",
              examples.offsets.back(), "; expected 0 to the number of tokens, ", n);
  const uint8_t* counted = mask.data_ptr<uint8_t>();
  for (int64_t e = 0; e + 1 < offsets.numel(); ++e) {
    TORCH_CHECK(examples.offsets[e] < examples.offsets[e + 1], path, ": example ", e,
                " spans tokens [", examples.offsets[e], ", ", examples.offsets[e + 1],
                "); expected strictly increasing example_offsets");
    TORCH_CHECK(counted[examples.offsets[e]] == 0, path, ": example ", e,
                "'s first token is marked as counted; nothing predicts it");
  }
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(counted[i] <= 1, path, ": loss_mask[", i, "] is ", int(counted[i]),
                "; expected 0 or 1");
  }
  const int32_t* raw = ids.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(raw[i] >= 0 && raw[i] < vocab_size, path, ": token ", i, " is ", raw[i],
                ", not in [0, vocab_size ", vocab_size,
                "); was the file made with this model's tokenizer?");
  }
  examples.ids = ids.to(at::kLong);
  examples.counted = mask.to(at::kBool);
  return examples;
}

double ChatRows::padding() const {
  if (rows() == 0) return 0;
  return (segments < 0).sum().item<double>() / double(segments.numel());
}

ChatRows pack_chat_rows(const ChatExamples& examples, int64_t context, ChatPacking packing,
                        LongExamples long_examples) {
  TORCH_CHECK(context >= 2, "pack_chat_rows: context ", context, " must hold 2 tokens or more");
  ChatRows out;
  const int64_t* ids = examples.ids.data_ptr<int64_t>();
  const bool* counted = examples.counted.data_ptr<bool>();
  // The examples that go in, with the length each keeps.
  struct Kept {
    int64_t example, length;
  };
  std::vector<Kept> kept;
  // Why examples were left out: too long (kDrop), no counted token at all, none before
  // the cut.
  int64_t too_long = 0, uncounted = 0, counted_past_cut = 0;
  const auto any_counted = [&](int64_t begin, int64_t end) {
    return std::any_of(counted + begin, counted + end, [](bool c) { return c; });
  };
  for (int64_t e = 0; e < examples.size(); ++e) {
    const int64_t begin = examples.offsets[e];
    const int64_t full = examples.length(e);
    if (full > context && long_examples == LongExamples::kDrop) {
      ++out.dropped, ++(any_counted(begin + 1, begin + full) ? too_long : uncounted);
      continue;
    }
    const int64_t length = std::min(full, context);
    if (!any_counted(begin + 1, begin + length)) {  // nothing to learn from what is left
      ++out.dropped, ++(any_counted(begin + 1, begin + full) ? counted_past_cut : uncounted);
      continue;
    }
    if (length < full) ++out.cut;
    kept.push_back({e, length});
  }
  TORCH_CHECK(!kept.empty(), "pack_chat_rows: none of the ", examples.size(),
              " examples is left with a counted token in a context of ", context, " (", out.dropped,
              " left out: ", too_long, " longer than the context with --long_examples=drop, ",
              counted_past_cut, " counting only tokens past it, ", uncounted,
              " counting no token at all)",
              uncounted == examples.size()
                  ? "; the file's loss_mask counts nothing: remake it (prepare_chat.py --mask, "
                    "and a chat template that marks the assistant's turns)"
              : too_long > 0 ? "; raise --context, or pass --long_examples=cut"
                             : "; raise --context");
  // rows[r]: the kept examples of row r, in order.
  std::vector<std::vector<Kept>> rows;
  if (packing == ChatPacking::kPerRow) {
    for (const Kept& k : kept) rows.push_back({k});
  } else {
    std::vector<Kept> order = kept;
    std::stable_sort(order.begin(), order.end(),
                     [](const Kept& a, const Kept& b) { return a.length > b.length; });
    std::multimap<int64_t, size_t> room;  // room left -> row
    for (const Kept& k : order) {
      const auto best = room.lower_bound(k.length);
      size_t row = rows.size();
      if (best == room.end()) {
        rows.emplace_back();
      } else {
        row = best->second;
        room.erase(best);
      }
      rows[row].push_back(k);
      int64_t used = 0;
      for (const Kept& placed : rows[row]) used += placed.length;
      if (used < context) room.emplace(context - used, row);
    }
  }
  const int64_t r_count = static_cast<int64_t>(rows.size());
  out.inputs = at::zeros({r_count, context}, at::kLong);
  out.targets = at::full({r_count, context}, -100, at::kLong);
  out.positions = at::zeros({r_count, context}, at::kLong);
  out.segments = at::full({r_count, context}, -1, at::kLong);
  int64_t* inputs = out.inputs.data_ptr<int64_t>();
  int64_t* targets = out.targets.data_ptr<int64_t>();
  int64_t* positions = out.positions.data_ptr<int64_t>();
  int64_t* segments = out.segments.data_ptr<int64_t>();
  for (int64_t r = 0; r < r_count; ++r) {
    int64_t at = r * context;
    for (size_t s = 0; s < rows[r].size(); ++s) {
      const Kept& k = rows[r][s];
      const int64_t begin = examples.offsets[k.example];
      for (int64_t p = 0; p < k.length; ++p, ++at) {
        inputs[at] = ids[begin + p];
        positions[at] = p;
        segments[at] = static_cast<int64_t>(s);
        if (p + 1 < k.length && counted[begin + p + 1]) {
          targets[at] = ids[begin + p + 1];
          ++out.counted;
        }
      }
    }
    out.examples += static_cast<int64_t>(rows[r].size());
  }
  return out;
}

// A token file's batch has no positions or segments (undefined tensors): they stay so.
ChatBatch ChatBatch::narrow(int64_t first, int64_t count) const {
  const auto rows = [&](const at::Tensor& t) {
    return t.defined() ? t.narrow(0, first, count) : t;
  };
  return {rows(inputs), rows(targets), rows(positions), rows(segments)};
}

ChatBatch ChatBatch::to(c10::Device device) const {
  const auto moved = [&](const at::Tensor& t) { return t.defined() ? t.to(device) : t; };
  return {moved(inputs), moved(targets), moved(positions), moved(segments)};
}

ChatBatch chat_training_rows(const ChatRows& rows, int64_t first, int64_t count, int64_t seed) {
  const int64_t r = rows.rows();
  std::vector<int64_t> picked;
  at::Tensor order;
  int64_t epoch = -1;
  for (int64_t g = first; g < first + count; ++g) {
    if (g / r != epoch) {
      epoch = g / r;
      at::manual_seed(seed * 1000003 + epoch);
      order = at::randperm(r, at::kLong);
    }
    picked.push_back(order[g % r].item<int64_t>());
  }
  const at::Tensor index = at::tensor(picked, at::kLong);
  return {rows.inputs.index_select(0, index), rows.targets.index_select(0, index),
          rows.positions.index_select(0, index), rows.segments.index_select(0, index)};
}

ChatBatch chat_rows(const ChatRows& rows, int64_t first, int64_t count) {
  return ChatBatch{rows.inputs, rows.targets, rows.positions, rows.segments}.narrow(first, count);
}

}  // namespace fsdp::models
