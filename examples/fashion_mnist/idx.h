// IDX files (the format of MNIST and Fashion-MNIST) read into tensors, through zlib so
// gzipped files (as Debian's dataset-fashion-mnist ships them) and plain ones both work.
//
//   fsdp::examples::IdxDataset train = fsdp::examples::read_idx_dataset(
//       "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz",
//       "/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz", /*flatten=*/true);
//   train.images;  // float32 [60000, 784], values in [0, 1]
//   train.labels;  // int64 [60000], values in [0, 9]
//
// Format (http://yann.lecun.com/exdb/mnist/): a big-endian header, then the values in
// row-major order. Images: magic 0x00000803 (unsigned bytes, 3 dimensions), then the
// count N, rows and columns as big-endian uint32, then N x rows x columns pixels.
// Labels: magic 0x00000801 (unsigned bytes, 1 dimension), then N, then N labels.
//
// Errors: c10::Error whose message names the file and says what was expected and what
// was found: a file that cannot be opened (with the system's reason), a wrong magic
// number, a truncated header or body, bytes after the declared data, corrupt gzip data,
// and image and label files of different counts.
//
// Threading: the functions keep no state; they may run concurrently on different files.
#ifndef EXAMPLES_FASHION_MNIST_IDX_H_
#define EXAMPLES_FASHION_MNIST_IDX_H_

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

namespace fsdp::examples {

inline constexpr uint32_t kIdxImagesMagic = 0x00000803;  // unsigned bytes, 3 dimensions
inline constexpr uint32_t kIdxLabelsMagic = 0x00000801;  // unsigned bytes, 1 dimension

// Images of an IDX file with magic 0x00000803: float32 [N, rows, columns] (flatten:
// [N, rows x columns]), each pixel byte divided by 255, so values lie in [0, 1].
at::Tensor read_idx_images(const std::string& path, bool flatten = false);

// Labels of an IDX file with magic 0x00000801: int64 [N], the bytes as they are.
at::Tensor read_idx_labels(const std::string& path);

struct IdxDataset {
  at::Tensor images;  // as read_idx_images returns them
  at::Tensor labels;  // as read_idx_labels returns them
  int64_t size() const { return labels.size(0); }
};

// Both files, checked to hold the same number of examples (image i has label i).
IdxDataset read_idx_dataset(const std::string& images_path, const std::string& labels_path,
                            bool flatten = false);

}  // namespace fsdp::examples

#endif  // EXAMPLES_FASHION_MNIST_IDX_H_
