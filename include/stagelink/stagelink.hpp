#pragma once
#include "stagelink/allocator.hpp"
#include "stagelink/config.hpp"
#include "stagelink/connector.hpp"
#include "stagelink/frame.hpp"
#include "stagelink/payload.hpp"
#include "stagelink/result.hpp"
#include "stagelink/shm.hpp"
