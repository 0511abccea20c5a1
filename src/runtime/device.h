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
// Weights take the checkpoint's dtype on a GPU (config.json torch_dtype, bf16 when absent) and
// fp32 on the CPU (--dtype auto); everything a job creates takes its device and dtype from the
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

// CUDA devices this process can use (0 without CUDA).
int cuda_device_count();

// Whether `gpus` GPUs give each of `local_ranks` ranks one of its own (what auto needs for cuda).
bool gpus_suffice(int local_ranks, int gpus);
// What --device auto says when it falls back to the CPU because the GPUs are fewer than the
// local ranks ("" when it does not).
std::string auto_device_note(int local_ranks, int gpus);

// --dtype: fp32 | bf16 | auto (fp32 on the CPU; on a GPU the checkpoint's torch_dtype,
// `checkpoint_dtype` as config.json spells it, bf16 when empty). Returns "fp32" or "bf16"
// (float16 checkpoints run in bf16: lvx's kernels accumulate in fp32 either way).
std::string resolve_dtype(const std::string& option, const at::Device& device,
                          const std::string& checkpoint_dtype);

}  // namespace lvx::runtime
