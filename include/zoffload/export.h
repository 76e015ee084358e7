// libzoffload's symbol visibility. The library is compiled with -fvisibility=hidden: what it
// defines stays inside it unless a public header declares it between ZO_API_BEGIN and
// ZO_API_END (every public header wraps its declarations so). Our own tests and tools link the
// same code statically and reach the internals that way.
#pragma once

#define ZO_API_BEGIN _Pragma("GCC visibility push(default)")
#define ZO_API_END _Pragma("GCC visibility pop")
