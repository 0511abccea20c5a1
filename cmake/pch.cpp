// Carrier of lvx's shared precompiled header (ATen), reused by every C++ target.
