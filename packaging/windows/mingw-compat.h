/* Declarations llama.cpp's CPU backend uses that Debian 12's mingw-w64 headers (v10)
 * lack (mingw-w64 v11 has them): the thread power-throttling state of Windows 10/11.
 * Only for cross-building shoal.exe on Debian 12 (packaging/windows/cross-build.sh
 * force-includes it into C files); MSVC and newer mingw-w64 do not need it. */
#ifdef _WIN32
#include <windows.h>
#ifndef THREAD_POWER_THROTTLING_CURRENT_VERSION
typedef struct _THREAD_POWER_THROTTLING_STATE {
    ULONG Version;
    ULONG ControlMask;
    ULONG StateMask;
} THREAD_POWER_THROTTLING_STATE;
#define THREAD_POWER_THROTTLING_CURRENT_VERSION 1
#define THREAD_POWER_THROTTLING_EXECUTION_SPEED 0x1
#endif
#endif
