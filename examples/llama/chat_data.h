// Conversations for supervised fine-tuning: the file examples/llama/prepare_chat.py
// writes (format "fsdp-chat-v1"), read and cut into rows of the trainer's context,
// several examples to a row (packing) or one.
//
//   const ChatExamples examples = read_chat_file("train.safetensors", config.vocab_size);
//   const ChatRows rows = pack_chat_rows(examples, /*context=*/512, ChatPacking::kPacked,
//                                        LongExamples::kCut);
//   // rows.inputs[r], rows.targets[r], rows.positions[r], rows.segments[r]: [context]
//
// The file is one safetensors file holding `input_ids` (int32 [N]: every example's
// tokens, in file order), `loss_mask` (uint8 [N]: 1 where token i counts as the target
// predicted from token i - 1 of its example, so never at an example's first token) and
// `example_offsets` (int64 [E + 1]: example e is tokens [offsets[e], offsets[e + 1]);
// 0 first, N last, strictly increasing), and __metadata__ "format": "fsdp-chat-v1". TRL's
// counterpart: SFTTrainer's tokenized dataset (input_ids, assistant_masks /
// completion_mask) with packing="bfd" and padding_free (position ids restarting at each
// example). Errors: c10::Error naming the file and what was expected.
#ifndef FSDP_EXAMPLES_LLAMA_CHAT_DATA_H_
#define FSDP_EXAMPLES_LLAMA_CHAT_DATA_H_

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace fsdp::models {

// The examples of a conversation file.
struct ChatExamples {
  at::Tensor ids;                // int64 [N]
  at::Tensor counted;            // bool [N]: token i is a target that counts
  std::vector<int64_t> offsets;  // [E + 1]
  int64_t size() const { return static_cast<int64_t>(offsets.size()) - 1; }
  int64_t length(int64_t e) const { return offsets[e + 1] - offsets[e]; }
};

// Reads and checks `path`: the three tensors with those dtypes and 1-D shapes, the
// metadata's format, offsets as above, every id below `vocab_size`, a 0 mask at each
// example's first token. Whole tensors are read (N tokens: 13 bytes each).
ChatExamples read_chat_file(const std::string& path, int64_t vocab_size);

enum class ChatPacking {
  kPacked,  // best-fit decreasing: few rows, little padding
  kPerRow,  // one example per row, padded
};

// What happens to an example of more than `context` tokens.
enum class LongExamples {
  kCut,   // its first `context` tokens are kept (TRL's max_length truncation)
  kDrop,  // it is left out
};

// Rows of `context` tokens. A row holds whole examples side by side; position p of a row
// belongs to example segments[r][p] (numbered from 0 within the row; -1 for padding),
// holds token inputs[r][p] at position positions[r][p] within its example (0 at its
// first token), and targets[r][p] is the next token of the same example when that token
// counts, else -100 (padding, an example's last token, a token that does not count).
// positions and segments are what models::PackedRowsScope takes.
struct ChatRows {
  at::Tensor inputs, targets, positions, segments;  // int64 [R, context]
  int64_t examples = 0;                             // examples placed
  int64_t cut = 0;                                  // of them, cut to the context
  int64_t dropped = 0;  // left out: too long (kDrop), or no counted target after a cut
  int64_t counted = 0;  // targets that count, in all rows
  int64_t rows() const { return inputs.defined() ? inputs.size(0) : 0; }
  // Padding positions / all positions.
  double padding() const;
};

// Packing: best-fit decreasing (TRL's "bfd"): examples by length, longest first (file
// order among equals), each into the row with the least room that still holds it, else a
// new row; rows in the order they were opened, examples within a row in the order they
// were placed. kPerRow: one example per row, in file order. Throws c10::Error if no
// example is left.
ChatRows pack_chat_rows(const ChatExamples& examples, int64_t context, ChatPacking packing,
                        LongExamples long_examples);

// The rows of a batch (each [rows, context], on the device the caller moves them to).
// A token file's windows leave positions and segments undefined (positions 0 ... context
// - 1, one segment a row); narrow() and to() keep them undefined.
struct ChatBatch {
  at::Tensor inputs, targets, positions, segments;
  ChatBatch narrow(int64_t first, int64_t count) const;  // rows [first, first + count)
  ChatBatch to(c10::Device device) const;
};

// Rows `first` ... `first + count - 1` of the training order of `rows`: epoch after epoch,
// each a permutation of the rows drawn from `seed` and the epoch's number (the same on
// every rank, whatever the world size), so global row g is in epoch g / R.
ChatBatch chat_training_rows(const ChatRows& rows, int64_t first, int64_t count, int64_t seed);

// Rows `first` ... `first + count - 1` of `rows` in their own order (evaluation).
ChatBatch chat_rows(const ChatRows& rows, int64_t first, int64_t count);

}  // namespace fsdp::models

#endif  // FSDP_EXAMPLES_LLAMA_CHAT_DATA_H_
