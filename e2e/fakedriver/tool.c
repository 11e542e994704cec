/*
 * gpu-dra fake driver root: nvidia-debugdump, nvidia-persistenced, nvidia-cuda-mps-control and
 * nvidia-cuda-mps-server, each this program built under the real name. Without arguments or with
 * --version it prints one version line and exits 0; anything else is refused (exit 2), since no
 * GPU or daemon is behind it. Not NVIDIA software.
 */
#include <stdio.h>
#include <string.h>

#ifndef FAKEDRIVER_TOOL
#error "build with -DFAKEDRIVER_TOOL=\"<program name>\""
#endif
#ifndef FAKEDRIVER_VERSION
#error "build with -DFAKEDRIVER_VERSION=\"<driver version>\""
#endif

int main(int argc, char **argv)
{
    if (argc == 1 || (argc == 2 && (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "-v") == 0))) {
        printf("%s: version %s (gpu-dra fake driver root)\n", FAKEDRIVER_TOOL, FAKEDRIVER_VERSION);
        return 0;
    }
    fprintf(stderr, "%s: %s: not available in the gpu-dra fake driver root (no GPU behind it)\n",
            FAKEDRIVER_TOOL, argv[1]);
    return 2;
}
