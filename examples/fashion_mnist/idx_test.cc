// The IDX reader on small files written here with zlib (gzipped and plain, good and
// broken), and on Debian's Fashion-MNIST test split when it is installed.
#include "examples/fashion_mnist/idx.h"

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <zlib.h>

namespace fsdp::examples {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

using Bytes = std::vector<uint8_t>;

// Two 2 x 3 images, then three labels.
const Bytes kPixels = {0, 255, 51, 102, 1, 254, 10, 20, 30, 40, 50, 60};
const Bytes kLabels = {9, 0, 3};

std::string temp_path(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
}

void append_u32(Bytes& bytes, uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8) bytes.push_back((value >> shift) & 0xff);
}

// An IDX file: magic, big-endian dimensions, data.
Bytes idx_file(uint32_t magic, const std::vector<uint32_t>& dims, const Bytes& data) {
  Bytes bytes;
  append_u32(bytes, magic);
  for (uint32_t dim : dims) append_u32(bytes, dim);
  bytes.insert(bytes.end(), data.begin(), data.end());
  return bytes;
}

Bytes images_file() { return idx_file(kIdxImagesMagic, {2, 2, 3}, kPixels); }
Bytes labels_file() { return idx_file(kIdxLabelsMagic, {3}, kLabels); }

std::string write_gzip(const std::string& name, const Bytes& bytes) {
  const std::string path = temp_path(name);
  gzFile file = gzopen(path.c_str(), "wb");
  EXPECT_NE(file, nullptr) << path;
  EXPECT_EQ(gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size())),
            static_cast<int>(bytes.size()));
  EXPECT_EQ(gzclose(file), Z_OK);
  return path;
}

std::string write_plain(const std::string& name, const Bytes& bytes) {
  const std::string path = temp_path(name);
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
  return path;
}

Bytes read_plain(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The message of the c10::Error `read` throws, or "no error".
std::string error_of(const std::function<void()>& read) {
  try {
    read();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

void expect_pixels(const at::Tensor& images) {
  ASSERT_EQ(images.scalar_type(), at::kFloat);
  ASSERT_EQ(images.numel(), static_cast<int64_t>(kPixels.size()));
  const float* values = images.data_ptr<float>();
  for (size_t i = 0; i < kPixels.size(); ++i) {
    EXPECT_EQ(values[i], static_cast<float>(kPixels[i]) / 255.0f) << "pixel " << i;
  }
  EXPECT_EQ(images.min().item<float>(), 0.0f);
  EXPECT_EQ(images.max().item<float>(), 1.0f);
}

TEST(IdxTest, ReadsImagesExactly) {
  const at::Tensor images = read_idx_images(write_gzip("images.gz", images_file()));
  EXPECT_EQ(images.sizes(), (std::vector<int64_t>{2, 2, 3}));
  expect_pixels(images);
}

TEST(IdxTest, FlattensImages) {
  const at::Tensor images =
      read_idx_images(write_gzip("images.gz", images_file()), /*flatten=*/true);
  EXPECT_EQ(images.sizes(), (std::vector<int64_t>{2, 6}));
  expect_pixels(images);
}

TEST(IdxTest, ReadsLabelsExactly) {
  const at::Tensor labels = read_idx_labels(write_gzip("labels.gz", labels_file()));
  ASSERT_EQ(labels.scalar_type(), at::kLong);
  EXPECT_TRUE(at::equal(labels, at::tensor({9, 0, 3}, at::kLong))) << labels;
}

TEST(IdxTest, ReadsPlainFilesToo) {
  expect_pixels(read_idx_images(write_plain("images", images_file())));
  EXPECT_TRUE(at::equal(read_idx_labels(write_plain("labels", labels_file())),
                        at::tensor({9, 0, 3}, at::kLong)));
}

TEST(IdxTest, ReadsEmptyFiles) {
  EXPECT_EQ(
      read_idx_images(write_gzip("empty.gz", idx_file(kIdxImagesMagic, {0, 28, 28}, {}))).sizes(),
      (std::vector<int64_t>{0, 28, 28}));
}

TEST(IdxTest, ReadsADatasetOfPairedFiles) {
  Bytes two_labels = idx_file(kIdxLabelsMagic, {2}, {4, 7});
  const IdxDataset dataset = read_idx_dataset(write_gzip("images.gz", images_file()),
                                              write_gzip("labels2.gz", two_labels), true);
  EXPECT_EQ(dataset.size(), 2);
  EXPECT_EQ(dataset.images.sizes(), (std::vector<int64_t>{2, 6}));
  EXPECT_TRUE(at::equal(dataset.labels, at::tensor({4, 7}, at::kLong)));
}

TEST(IdxTest, MissingFileNamesThePathAndTheReason) {
  const std::string path = temp_path("no-such-file.gz");
  EXPECT_THAT(error_of([&] { read_idx_images(path); }),
              AllOf(HasSubstr("cannot open IDX file '" + path + "': No such file or directory"),
                    HasSubstr("dataset-fashion-mnist")));
}

TEST(IdxTest, LabelsFileReadAsImagesIsAWrongMagic) {
  const std::string path = write_gzip("labels.gz", labels_file());
  EXPECT_THAT(error_of([&] { read_idx_images(path); }),
              HasSubstr("'" + path +
                        "' is not an IDX images file: its magic number is 0x00000801, expected "
                        "0x00000803 (images: unsigned bytes, 3 dimensions)"));
}

TEST(IdxTest, ImagesFileReadAsLabelsIsAWrongMagic) {
  const std::string path = write_gzip("images.gz", images_file());
  EXPECT_THAT(error_of([&] { read_idx_labels(path); }),
              HasSubstr("'" + path +
                        "' is not an IDX labels file: its magic number is 0x00000803, expected "
                        "0x00000801 (labels: unsigned bytes, 1 dimension)"));
}

TEST(IdxTest, TextFileIsAWrongMagic) {
  const std::string path = write_plain("notes.txt", Bytes{'h', 'e', 'l', 'l', 'o', '\n'});
  EXPECT_THAT(error_of([&] { read_idx_images(path); }),
              HasSubstr("its magic number is 0x68656c6c, expected 0x00000803"));
}

TEST(IdxTest, FileShorterThanTheMagicIsTruncated) {
  const std::string path = write_gzip("tiny.gz", Bytes{0, 0});
  EXPECT_THAT(error_of([&] { read_idx_images(path); }),
              HasSubstr("IDX file '" + path +
                        "' is truncated: it has 2 bytes, expected at least the 16-byte header"));
}

TEST(IdxTest, TruncatedHeader) {
  const std::string path = write_gzip("header.gz", idx_file(kIdxImagesMagic, {60000}, {}));
  EXPECT_THAT(
      error_of([&] { read_idx_images(path); }),
      HasSubstr("IDX file '" + path + "' is truncated: its header has 8 bytes, expected 16"));
}

TEST(IdxTest, TruncatedData) {
  Bytes bytes = images_file();
  bytes.resize(bytes.size() - 5);
  const std::string path = write_gzip("short.gz", bytes);
  EXPECT_THAT(error_of([&] { read_idx_images(path); }),
              HasSubstr("IDX file '" + path +
                        "' is truncated: its header declares dimensions [2, 2, 3] (12 bytes of "
                        "data), found 7 bytes"));
}

TEST(IdxTest, TruncatedLabels) {
  const std::string path =
      write_gzip("labels-short.gz", idx_file(kIdxLabelsMagic, {10000}, kLabels));
  EXPECT_THAT(error_of([&] { read_idx_labels(path); }),
              HasSubstr("is truncated: its header declares dimensions [10000] (10000 bytes of "
                        "data), found 3 bytes"));
}

TEST(IdxTest, GzipStreamCutShortIsTruncated) {
  Bytes pixels(100 * 28 * 28);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>(i * 7919 % 251);
  const Bytes gzipped =
      read_plain(write_gzip("full.gz", idx_file(kIdxImagesMagic, {100, 28, 28}, pixels)));
  const std::string path =
      write_plain("cut.gz", Bytes(gzipped.begin(), gzipped.begin() + gzipped.size() / 2));
  EXPECT_THAT(error_of([&] { read_idx_images(path); }),
              AllOf(HasSubstr("IDX file '" + path + "' is truncated"),
                    HasSubstr("(78400 bytes of data)"), HasSubstr("(the gzip stream ends early)")));
}

TEST(IdxTest, CorruptGzipData) {
  Bytes gzipped = read_plain(write_gzip("good.gz", images_file()));
  for (size_t i = 10; i < gzipped.size() - 8; ++i) gzipped[i] = 0xff;  // the deflate data
  const std::string path = write_plain("corrupt.gz", gzipped);
  EXPECT_THAT(error_of([&] { read_idx_images(path); }),
              AllOf(HasSubstr("cannot read IDX file '" + path + "': "),
                    HasSubstr("(the gzip data is corrupt)")));
}

TEST(IdxTest, BytesAfterTheDeclaredData) {
  Bytes bytes = labels_file();
  bytes.push_back(1);
  const std::string path = write_gzip("long.gz", bytes);
  EXPECT_THAT(error_of([&] { read_idx_labels(path); }),
              HasSubstr("IDX file '" + path +
                        "' has bytes after the data its header declares (dimensions [3])"));
}

TEST(IdxTest, MismatchedCountsNameBothFiles) {
  const std::string images = write_gzip("images.gz", images_file());
  const std::string labels = write_gzip("labels.gz", labels_file());
  EXPECT_THAT(error_of([&] { read_idx_dataset(images, labels); }),
              HasSubstr("'" + images + "' holds 2 images but '" + labels +
                        "' holds 3 labels; expected one label per image"));
}

// Debian's dataset-fashion-mnist: 10000 test images, 1000 of each class.
TEST(IdxTest, FashionMnistTestSplit) {
  const std::string dir = "/usr/share/datasets/fashion-mnist/";
  if (!std::ifstream(dir + "t10k-labels-idx1-ubyte.gz")) {
    GTEST_SKIP() << "Debian's dataset-fashion-mnist is not installed (" << dir << ")";
  }
  const IdxDataset test = read_idx_dataset(dir + "t10k-images-idx3-ubyte.gz",
                                           dir + "t10k-labels-idx1-ubyte.gz", /*flatten=*/true);
  EXPECT_EQ(test.images.sizes(), (std::vector<int64_t>{10000, 784}));
  EXPECT_TRUE(at::equal(at::bincount(test.labels), at::full({10}, 1000, at::kLong)));
  EXPECT_EQ(test.images.min().item<float>(), 0.0f);
  EXPECT_EQ(test.images.max().item<float>(), 1.0f);
}

}  // namespace
}  // namespace fsdp::examples
