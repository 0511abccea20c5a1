# System dependencies (Debian 12 packages installed by setup.sh).
find_package(PkgConfig REQUIRED)
pkg_check_modules(FFMPEG REQUIRED IMPORTED_TARGET libavformat libavcodec libavutil libswscale)
# OpenCV core+imgproc only (Debian's libopencv-{core,imgproc}-dev ship no CMake config; the full
# libopencv-dev would pull hundreds of packages).
find_path(OpenCV_INCLUDE_DIRS opencv2/core.hpp PATH_SUFFIXES opencv4 REQUIRED)
find_library(OPENCV_CORE_LIB opencv_core REQUIRED)
find_library(OPENCV_IMGPROC_LIB opencv_imgproc REQUIRED)
set(OpenCV_LIBS ${OPENCV_IMGPROC_LIB} ${OPENCV_CORE_LIB})
find_package(yaml-cpp REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(Threads REQUIRED)
find_path(GLOO_INCLUDE_DIR gloo/context.h REQUIRED)
target_include_directories(lvx_torch SYSTEM INTERFACE ${GLOO_INCLUDE_DIR})
if(LVX_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
# Tokenizers (models/tokenizer.cpp): PCRE2 runs the pre-tokenizer regexes (\p{L}, lookahead), ICU
# gives Unicode normalization (NFC...) and character properties.
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
pkg_check_modules(ICU REQUIRED IMPORTED_TARGET icu-uc)
# lvx serve's HTTP (src/serve/): cpp-httplib 0.11 (Debian's libcpp-httplib-dev, a compiled
# library with its header).
pkg_check_modules(HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)
# Checkpoint manifests (src/common/files.cpp): xxHash's XXH3-64 checksums every file of a
# checkpoint at memory speed, so verifying a 15 GB checkpoint is not what bounds a load or save.
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
