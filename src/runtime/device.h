// Where a job's tensors live: one rule for every command that computes (lvx qa, finetune,
// forward, demo, calibrate: their --device option, src/cli/args.h add_device_option).
//   auto  cuda:LOCAL_RANK when this lvx sees at least one CUDA device per local rank, else cpu
//         (with a note on stderr when GPUs are there but fewer than the local ranks);
//   cuda  cuda:LOCAL_RANK, an error when there is no CUDA device;
//   cpu   cpu.
// Each local rank gets a GPU of its own: with --device cuda, fewer GPUs than local ranks is
// refused with a message naming both counts and the --nproc that fits (NCCL refuses two ranks
// on one GPU, and sharing one silently would also share its memory), never wrapped round.
//
// Weights take the checkpoint's dtype where the device computes it natively (resolve_dtype,
// --dtype auto); everything a job creates takes its device and dtype from the
// tensors it relates to (tests/test_models_placement.cpp runs both families on `meta` to check).
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace lvx::runtime {

// The device of local rank `local_rank` of `local_world` for `spec` (auto | cuda | cpu) when
// this machine has `gpus` CUDA devices. Errors name the option, the value and the counts.
at::Device choose_device(const std::string& spec, int local_rank, int local_world, int gpus);

// The same with this process's CUDA device count and its local rank (LOCAL_RANK and
// LOCAL_WORLD_SIZE, as torchrun and lvx's launcher set them; 0 and 1 when absent). On a CUDA
// device it also makes that device current.
at::Device choose_device(const std::string& spec);

// In a launcher, before it starts `local_ranks` ranks: refuses what every rank would refuse (no
// GPU for --device cuda, fewer GPUs than ranks), once and clearly. Counts GPUs only unless cpu.
void check_local_devices(const std::string& spec, int local_ranks);

// Checks the option's spelling only (auto | cuda | cpu): for validation before the ranks start,
// which may run where the GPUs are not (check_local_devices checks the counts).
void check_device_option(const std::string& spec);

// Whether this CPU multiplies bf16 natively (AMX-BF16, or AVX512-BF16), with the OS saving that
// state (XCR0): what --dtype auto asks of a CPU.
bool cpu_computes_bf16();

// CUDA devices this process can use (0 without CUDA).
int cuda_device_count();

// Whether `gpus` GPUs give each of `local_ranks` ranks one of its own (what auto needs for cuda).
bool gpus_suffice(int local_ranks, int gpus);
// What --device auto says when it falls back to the CPU because the GPUs are fewer than the
// local ranks ("" when it does not).
std::string auto_device_note(int local_ranks, int gpus);

// --dtype: fp32 | bf16 | auto. auto: the checkpoint's dtype (`checkpoint_dtype`, as
// model_description.h's checkpoint_dtype names the weights' stored dtype: float32 | float16 |
// bfloat16) wherever the device runs it at least as fast: a bf16 or fp16 checkpoint runs in bf16
// on a GPU and on a CPU with native bf16 products (`cpu_bf16`: cpu_computes_bf16), in fp32 on
// other CPUs; an fp32 checkpoint in fp32. Returns "fp32" or "bf16" (lvx's kernels accumulate in
// fp32 either way).
std::string resolve_dtype(const std::string& option, const at::Device& device,
                          const std::string& checkpoint_dtype, bool cpu_bf16 = cpu_computes_bf16());
// What rank 0 prints when auto chose for a bf16 or fp16 checkpoint (empty for an explicit --dtype
// and for fp32 checkpoints, which run in fp32): the choice and why.
std::string dtype_note(const std::string& option, const at::Device& device,
                       const std::string& checkpoint_dtype, const std::string& chosen);

}  // namespace lvx::runtime
