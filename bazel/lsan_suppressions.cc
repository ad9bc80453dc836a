// LeakSanitizer's built-in suppressions for our tests (linked into every fsdp_cc_test;
// LSan reads __lsan_default_suppressions at exit, under --config=asan only).
//
// c10d::FlightRecorder (LibTorch 2.11) records each collective a process group enqueues.
// Now and then (not every run) LSan reports 56 bytes allocated in
// FlightRecorder<c10::Event>::recordWithResetEnabled as a direct leak at exit, in a test
// whose own code frees everything (//fsdp/comm:nccl_device_calls_test, CI of 2026-12-05).
// The allocation is LibTorch's; without this a test fails by chance.

extern "C" const char* __lsan_default_suppressions();

extern "C" const char* __lsan_default_suppressions() { return "leak:c10d::FlightRecorder\n"; }
