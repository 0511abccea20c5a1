// main() of every lvx test binary: runs a multi-rank worker when started by run_ranks()
// (LVX_TEST_WORKER set), the GoogleTest suite otherwise.
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>

#include "src/common/error.h"
#include "tests/multirank.h"

int main(int argc, char** argv) {
  if (const char* worker = std::getenv("LVX_TEST_WORKER")) {
    auto& table = lvx::testing::worker_table();
    auto it = table.find(worker);
    if (it == table.end()) {
      std::cerr << "no test worker named " << worker << "\n";
      return 2;
    }
    try {
      return it->second();
    } catch (const std::exception& e) {
      std::cerr << "worker " << worker << " failed: " << e.what() << std::endl;
      return 1;
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
