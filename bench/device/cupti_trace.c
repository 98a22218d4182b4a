// A GPU activity tracer for any CUDA program, with no profiler installed: the CUDA driver
// loads it when CUDA_INJECTION64_PATH names it, and it records through CUPTI (the wheel
// nvidia-cuda-cupti) every kernel (also inside CUDA graphs), copy, memset and Unified Memory
// transfer/fault, one tab-separated line each, into the file CUPTI_TRACE_OUT:
//   K start end stream name        (kernel; times in ns, GPU clock)
//   C start end stream bytes kind  (memcpy; kind: CUpti_ActivityMemcpyKind)
//   S start end stream bytes       (memset)
//   U start end counter value      (Unified Memory: 1 HtoD bytes, 2 DtoH bytes, 4 GPU fault...)
//   A start end thread name        (CUDA driver API call on the CPU; CUPTI_TRACE_API=1 only)
// Lines are written when CUPTI hands a buffer back and at exit. bench/device/gpu_trace.py
// reads them. Built and used by bench/device/kernel-trace.sh:
//   cc -shared -fPIC -O2 -I CUPTI/include -I CUDA/include cupti_trace.c -L CUPTI/lib -lcupti
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

static FILE *out;

static void CUPTIAPI requested(uint8_t **buffer, size_t *size, size_t *max_records) {
  *size = 16 << 20;
  *buffer = aligned_alloc(8, *size);
  *max_records = 0;
}

static void CUPTIAPI completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
  (void)ctx, (void)stream, (void)size;
  CUpti_Activity *r = NULL;
  while (out && cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
    switch (r->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        CUpti_ActivityKernel10 *k = (CUpti_ActivityKernel10 *)r;
        fprintf(out, "K\t%llu\t%llu\t%u\t%s\n", (unsigned long long)k->start, (unsigned long long)k->end,
                k->streamId, k->name);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        CUpti_ActivityMemcpy6 *c = (CUpti_ActivityMemcpy6 *)r;
        fprintf(out, "C\t%llu\t%llu\t%u\t%llu\t%u\n", (unsigned long long)c->start, (unsigned long long)c->end,
                c->streamId, (unsigned long long)c->bytes, c->copyKind);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        CUpti_ActivityMemset4 *s = (CUpti_ActivityMemset4 *)r;
        fprintf(out, "S\t%llu\t%llu\t%u\t%llu\n", (unsigned long long)s->start, (unsigned long long)s->end,
                s->streamId, (unsigned long long)s->bytes);
        break;
      }
      case CUPTI_ACTIVITY_KIND_UNIFIED_MEMORY_COUNTER: {
        CUpti_ActivityUnifiedMemoryCounter3 *u = (CUpti_ActivityUnifiedMemoryCounter3 *)r;
        fprintf(out, "U\t%llu\t%llu\t%d\t%llu\n", (unsigned long long)u->start, (unsigned long long)u->end,
                (int)u->counterKind, (unsigned long long)u->value);
        break;
      }
      case CUPTI_ACTIVITY_KIND_DRIVER: {
        CUpti_ActivityAPI *a = (CUpti_ActivityAPI *)r;
        const char *name = "?";
        cuptiGetCallbackName(CUPTI_CB_DOMAIN_DRIVER_API, a->cbid, &name);
        fprintf(out, "A\t%llu\t%llu\t%u\t%s\n", (unsigned long long)a->start, (unsigned long long)a->end,
                a->threadId, name);
        break;
      }
      default:
        break;
    }
  }
  free(buffer);
}

static void finish(void) {
  cuptiActivityFlushAll(1);
  if (out) {
    fclose(out);
    out = NULL;
  }
}

static void check(CUptiResult r, const char *what) {
  if (r != CUPTI_SUCCESS) {
    const char *msg = "?";
    cuptiGetResultString(r, &msg);
    fprintf(stderr, "cupti_trace: %s: %s\n", what, msg);
  }
}

int InitializeInjection(void) {
  const char *path = getenv("CUPTI_TRACE_OUT");
  out = fopen(path ? path : "cupti-trace.tsv", "w");
  if (!out) {
    perror("cupti_trace: CUPTI_TRACE_OUT");
    return 0;
  }
  check(cuptiActivityRegisterCallbacks(requested, completed), "register callbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "kernels");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "copies");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "memsets");
  // Driver API calls show where the CPU side of a step goes (graph node adds, launches,
  // event records); each record costs a little time, so it is opt-in.
  const char *api = getenv("CUPTI_TRACE_API");
  if (api && api[0] == '1') check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER), "driver API");
  CUpti_ActivityUnifiedMemoryCounterConfig um[3] = {
      {CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_SCOPE_PROCESS_SINGLE_DEVICE,
       CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_BYTES_TRANSFER_HTOD, 0, 1},
      {CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_SCOPE_PROCESS_SINGLE_DEVICE,
       CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_BYTES_TRANSFER_DTOH, 0, 1},
      {CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_SCOPE_PROCESS_SINGLE_DEVICE,
       CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_GPU_PAGE_FAULT, 0, 1},
  };
  CUptiResult r = cuptiActivityConfigureUnifiedMemoryCounter(um, 3);
  check(r, "unified memory counters");
  if (r == CUPTI_SUCCESS) check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_UNIFIED_MEMORY_COUNTER), "unified memory");
  atexit(finish);
  return 1;
}
