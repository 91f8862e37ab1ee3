// Runs an AOTInductor package (.pt2) with no Python in the process: the inputs come from a file written by
// torch.save([tensor, ...]); the outputs go to a file torch.load reads as a tuple. Built and run by
// msda_testkit.deploy; usage: aoti_runner PACKAGE.pt2 INPUTS.pt OUTPUTS.pt DEVICE [REPEATS]
// (DEVICE cpu or cuda; with REPEATS it also prints the median milliseconds of that many runs).
#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <iterator>
#include <torch/cuda.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/serialize.h>

static std::vector<char> read_file(const char* path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) {
    std::cerr << "usage: aoti_runner PACKAGE.pt2 INPUTS.pt OUTPUTS.pt DEVICE [REPEATS]\n";
    return 2;
  }
  const c10::Device device(argv[4]);
  torch::inductor::AOTIModelPackageLoader loader(argv[1]);
  c10::IValue saved = torch::pickle_load(read_file(argv[2]));  // a Python list of tensors
  std::vector<at::Tensor> inputs;
  for (const auto& item : saved.toListRef()) inputs.push_back(item.toTensor().to(device));
  auto outputs = loader.run(inputs);
  if (argc == 6) {
    std::vector<double> times;
    for (int i = 0; i < 3 + std::stoi(argv[5]); ++i) {  // 3 warm-up runs, not counted
      auto start = std::chrono::steady_clock::now();
      loader.run(inputs);
      if (device.is_cuda()) torch::cuda::synchronize();
      times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    times.erase(times.begin(), times.begin() + 3);
    std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
    std::cout << "median_ms=" << times[times.size() / 2] << "\n";
  }
  std::vector<c10::IValue> items;
  for (const auto& t : outputs) items.push_back(t.cpu());
  auto bytes = torch::pickle_save(c10::ivalue::Tuple::create(std::move(items)));  // torch.load reads a tuple
  std::ofstream(argv[3], std::ios::binary).write(bytes.data(), bytes.size());
  return 0;
}
